"""Pictures of real runs: timeline traces (HTML + SVG, PNG)."""

from .trace import TraceGroup, TraceRun, build_run, render_html, render_png, render_svg, trace_prompts, write_trace

__all__ = ["TraceGroup", "TraceRun", "build_run", "render_html", "render_png", "render_svg", "trace_prompts", "write_trace"]
