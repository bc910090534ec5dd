"""The key of a copy derived from weights and cached beside them (a weight's kernel panels, a folded MTP module, a
draft-vocabulary head, a compiled step's parameters): it changes whenever a weight is replaced or updated in place,
so the copy is rebuilt then and only then. Below kernels/ and models/, which both keep such copies."""

from __future__ import annotations


def weights_version(tensors) -> tuple:
    """A key that changes whenever one of `tensors` is replaced or updated in place (an optimizer step)."""
    # an inference tensor has no version counter (and cannot be updated in place)
    return tuple((t.data_ptr(), t.dtype, None if t.is_inference() else t._version) for t in tensors)
