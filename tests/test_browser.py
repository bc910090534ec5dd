"""End to end in a real browser: `mtpspec serve`'s page in headless Debian chromium, driven by Playwright.

The server runs in a thread on 127.0.0.1 (a free port) and serves two models by name (stories260K and its
8-bit copy, which also drafts for it); the test picks a model on the page, types a prefix and a draft, and
checks the accept/reject cells and the top-K list against the JSON API's answer.
Chromium is Debian's (/usr/bin/chromium, installed by `make test`); no browser is ever downloaded. Without
it the test skips, unless MTPSPEC_REQUIRE_BROWSER=1 (as CI sets), where it fails.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PREFIX = "Once upon a time, there was a little girl named Lily. She loved to"
DRAFT = " play outside in the garden with her dog"


def _chromium() -> str | None:
    for cand in (os.environ.get("MTPSPEC_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if cand and Path(cand).exists():
            return cand
    return None


def _need(what: str):
    if os.environ.get("MTPSPEC_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{what} (MTPSPEC_REQUIRE_BROWSER=1: the browser test must run)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def server(assets):
    import uvicorn

    from mtpspec.server import create_app
    from mtpspec.server.registry import load_served

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = assets / "models"
    served = load_served([f"stories={m / 'stories260K.bin'}", f"q80={m / 'stories260K_q80.bin'}"])
    model = "stories"
    srv = uvicorn.Server(uvicorn.Config(create_app(served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(url + "/api/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            srv.should_exit = True
            pytest.fail("server did not start within 20 s")
        time.sleep(0.1)
    try:
        yield url, model
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def page(server):
    exe = _chromium()
    if exe is None:
        _need("chromium not found (apt-get install chromium; `make test` installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need("the playwright python package is not installed")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True, timeout=60_000)
        try:
            pg = browser.new_page(viewport={"width": 1150, "height": 1000})
            pg.set_default_timeout(30_000)
            yield pg
        finally:
            browser.close()


def _open(page, url: str) -> None:
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('loaded')")
    assert page.input_value("#model") == "stories"  # the server's default


def test_verify_page_cells_and_top_k_match_the_api(server, page, tmp_path):
    url, model = server
    _open(page, url)
    assert "Greedy verification" in page.inner_text("body")
    page.fill("#prefix", PREFIX)
    page.fill("#draft", DRAFT)
    page.fill("#topk", "5")
    page.click("#verify")
    page.wait_for_selector("#cells .cell")
    api = httpx.post(url + "/api/verify", json={"model": model, "prefix": PREFIX, "draft": DRAFT, "top_k": 5}, timeout=30).json()
    cells = page.query_selector_all("#cells .cell")
    assert [c.get_attribute("data-status") for c in cells] == [p["status"] for p in api["positions"]]
    assert "accepted" in [p["status"] for p in api["positions"]] and "rejected" in [p["status"] for p in api["positions"]]
    for cell, pos in zip(cells, api["positions"]):
        assert int(cell.query_selector("[data-role=target]").get_attribute("data-id")) == pos["target"]["id"]
    n = api["num_accepted"]
    rejected = cells[n]
    rejected.query_selector("summary").click()  # expand the top-K distribution at the first mismatch
    items = rejected.query_selector_all("ol.topk li")
    assert all(i.is_visible() for i in items)
    assert [int(i.get_attribute("data-id")) for i in items] == [t["id"] for t in api["positions"][n]["top"]]
    assert [i.query_selector(".tp").inner_text() for i in items] == [f"{100 * t['p']:.1f}%" for t in api["positions"][n]["top"]]
    assert page.inner_text("#verdict").startswith(f"{n} of {api['num_drafted']}")
    shot = Path(os.environ.get("MTPSPEC_SCREENSHOT_DIR", tmp_path)) / "verify_page.png"
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 10_000


def test_errors_are_visible_and_the_server_keeps_running(server, page):
    url, _ = server
    _open(page, url)
    page.fill("#prefix", "")
    page.click("#verify")
    page.wait_for_selector("#error", state="visible")
    assert "prefix: empty" in page.inner_text("#error")
    page.fill("#prefix", PREFIX)
    page.select_option("#drafter", "ngram")
    page.fill("#k", "0")
    page.click("#verify")
    page.wait_for_function("document.getElementById('error').textContent.includes('k: ')")
    page.fill("#k", "3")
    page.fill("#draft", " play")
    page.click("#verify")
    page.wait_for_selector("#cells .cell")
    assert not page.is_visible("#error")


def test_the_page_chooses_among_the_served_models(server, page):
    url, _ = server
    _open(page, url)
    assert [o.get_attribute("value") for o in page.query_selector_all("#model option")] == ["stories", "q80"]
    page.select_option("#drafter", "draft")
    assert [o.get_attribute("value") for o in page.query_selector_all("#draft-model option")] == ["q80"]
    page.evaluate("document.getElementById('status').textContent = ''")
    page.select_option("#model", "q80")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('loaded')")
    page.fill("#prefix", PREFIX)
    page.fill("#draft", DRAFT)
    page.click("#verify")
    page.wait_for_selector("#cells .cell")
    api = httpx.post(url + "/api/verify", json={"model": "q80", "prefix": PREFIX, "draft": DRAFT}, timeout=30).json()
    assert [c.get_attribute("data-status") for c in page.query_selector_all("#cells .cell")] == [p["status"] for p in api["positions"]]


def test_step_through_a_real_run(server, page, assets):
    _open(page, server[0])
    page.fill("#prefix", PREFIX)
    page.select_option("#drafter", "draft")
    page.select_option("#draft-model", "q80")
    page.fill("#k", "4")
    page.fill("#steps-n", "24")
    page.click("#run")
    page.wait_for_selector("#step-table")
    assert "identical to plain: yes" in page.inner_text("#run-summary")
    rows = page.query_selector_all("#step-table tr[data-status]")
    statuses = [r.get_attribute("data-status") for r in rows]
    assert statuses[-1] in ("bonus", "not reached") and len(statuses) == 5
    assert "accepted" in statuses  # the page opens on a round where acceptance stopped part-way
    assert "plain decoding" in page.inner_text("#step-cost")
    shot_dir = os.environ.get("MTPSPEC_SCREENSHOT_DIR")
    if shot_dir:  # the README's picture of a round: `make screenshots`
        page.locator("#step-section").screenshot(path=str(Path(shot_dir) / "step_through.png"))
    page.fill("#step-i", "1")
    page.dispatch_event("#step-i", "change")
    assert page.inner_text("#step").startswith("Round 1:")
    page.click("#next")
    assert page.input_value("#step-i") == "2" and page.inner_text("#step").startswith("Round 2:")


def _fill_tree_form(page, url: str) -> None:
    """The page with a prefix, the Q8_0 draft model drafting trees of at most 8 nodes, D = 4."""
    _open(page, url)
    page.fill("#prefix", PREFIX)
    page.select_option("#drafter", "draft")
    page.select_option("#draft-model", "q80")
    page.fill("#k", "4")
    page.fill("#tree", "8")
    page.fill("#tree-beam", "4")  # its best path is right ~95% of the time: a beam of 4 branches where a beam of 1 rarely leaves it


def test_step_through_draws_a_token_tree(server, page, tmp_path):
    """Tree nodes 8: the round shown is drawn as a tree whose nodes carry the API's statuses (accepted path, rejected,
    discarded) and the target's own token after the path; a chain run still draws its table."""
    url, model = server
    _fill_tree_form(page, url)
    page.fill("#steps-n", "24")
    page.click("#run")
    page.wait_for_selector("#tree-svg")
    assert "identical to plain: yes" in page.inner_text("#run-summary")
    api = httpx.post(url + "/api/step", json={"model": model, "prefix": PREFIX, "drafter": "draft", "draft_model": "q80", "k": 4,
                                              "tree": 8, "tree_beam": 4, "max_new_tokens": 24}, timeout=60).json()
    i = int(page.input_value("#step-i")) - 1
    tree = api["steps"][i]["tree"]
    assert tree["is_tree"]
    nodes = page.query_selector_all("#tree-svg g.tnode")
    drawn = {g.get_attribute("data-node"): (g.get_attribute("data-status"), int(g.get_attribute("data-id"))) for g in nodes}
    want = {str(x["index"]): (x["status"], x["id"]) for x in tree["nodes"]}
    want["root"] = ("root", tree["root"]["id"])
    want["target"] = (tree["target"]["kind"], tree["target"]["id"])
    assert drawn == want
    statuses = {s for s, _ in drawn.values()}
    assert {"accepted", "rejected", "discarded"} <= statuses  # the page opens on a round that shows all three
    edges = page.query_selector_all("#tree-svg path.edge")
    assert len(edges) == len(nodes) - 1  # one edge into every node but the root
    assert sum(e.get_attribute("class") == "edge accepted" for e in edges) == len(tree["path"])
    rows = page.query_selector_all("#tree-table tr[data-status]")
    assert [r.get_attribute("data-status") for r in rows] == [x["status"] for x in tree["nodes"]] + [tree["target"]["kind"]]
    assert "discarded (under a rejected node" in page.inner_text("#tree-summary")
    shot = Path(os.environ.get("MTPSPEC_SCREENSHOT_DIR", tmp_path)) / "step_through_tree.png"
    page.locator("#step-section").screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    page.fill("#tree", "0")  # a chain again: the table, no tree
    page.click("#run")
    page.wait_for_selector("#step-table")
    assert not page.query_selector("#tree-svg")
    page.fill("#tree", "99")  # out of range: the API's error, shown on the page
    page.click("#run")
    page.wait_for_function("document.getElementById('error').textContent.includes('tree: ')")


def test_verify_a_proposed_token_tree(server, page):
    """One verify round of a drafter's tree: drawn with the API's statuses; the cells follow the accepted path."""
    url, model = server
    _fill_tree_form(page, url)
    page.click("#verify")
    page.wait_for_selector("#verify-tree")
    api = httpx.post(url + "/api/verify", json={"model": model, "prefix": PREFIX, "drafter": "draft", "draft_model": "q80", "k": 4,
                                                "tree": 8, "tree_beam": 4}, timeout=30).json()
    tree = api["tree"]
    drawn = [(g.get_attribute("data-node"), g.get_attribute("data-status")) for g in page.query_selector_all("#verify-tree g.tnode")]
    assert sorted(drawn) == sorted([(str(x["index"]), x["status"]) for x in tree["nodes"]] + [("root", "root"),
                                                                                           ("target", tree["target"]["kind"])])
    assert "rejected" in dict(drawn).values()
    cells = page.query_selector_all("#cells .cell")
    assert [c.get_attribute("data-status") for c in cells] == [p["status"] for p in api["positions"]]
    assert f"tree of {api['num_drafted']} nodes" in page.inner_text("#verdict")
