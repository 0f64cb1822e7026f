"""Conformance kit: any context-parallel attention against a float64 oracle on fake devices.

Give :func:`run` a function with ``jax.nn.dot_product_attention``'s calling convention that
runs context-parallel over a mesh (or a ring_jax ``HopKernel``); it runs the named cases
(:data:`CASES`, :func:`case_names`) on fake CPU devices and compares the output and the
gradients (``q``, ``k``, ``v``, and ``sinks`` / lse where the function has them) with
:func:`ring_jax.testing.oracle.attention`, dense numpy float64 attention that shares no code
with the library. Each case passes, fails (with the error, or the exception the function
raised) or is "not supported" (the function's signature lacks a keyword the case passes).

The calling convention::

    out = fn(query, key, value, *, is_causal, scale, mesh, [segment_ids], [layout],
             [inputs_in_layout], [local_window_size], [sinks], [logits_soft_cap],
             [return_lse])

``query`` ``[B, T, N, H]``, ``key`` ``[B, S, K, H]``, ``value`` ``[B, S, K, Hv]`` global
arrays in natural order (layout order when ``inputs_in_layout``); ``mesh`` the kit's fake-
device mesh (axis ``"sequence"``, and ``"tensor"`` before it in one case); segment ids
``[B, L]`` int32, 0 is padding (attended by nothing; a row with no visible key returns 0
with zero gradients); ``local_window_size`` ``(left, right)``; ``sinks`` ``[N]`` float32;
a function that takes ``return_lse`` returns ``(out, lse [B, T, N])`` and its lse is
checked too. ``out`` must be ``[B, T, N, Hv]`` in ``query.dtype``.

The CLI (sets 8 fake CPU devices before JAX starts)::

    python -m ring_jax.testing MODULE:FUNCTION [--cases a,b] [--mesh 2,4] [--list]

Docs: docs/conformance.md. This package needs JAX and numpy only (no Flax, no pytest).
"""

from ring_jax.testing.cases import CASES, CI_CASES, GROWTH, Case, case_names, select
from ring_jax.testing.hop import HOP_CASES, HOP_SHARDS, run_hop, run_hop_case
from ring_jax.testing.oracle import attention as oracle_attention
from ring_jax.testing.runner import (FAIL, NOT_SUPPORTED, PASS, Report, Row,
                                     hop_kernel_attention, run, run_case, tolerance)

__all__ = [
    "CASES", "CI_CASES", "FAIL", "GROWTH", "HOP_CASES", "HOP_SHARDS", "NOT_SUPPORTED", "PASS",
    "Case", "Report", "Row", "case_names", "hop_kernel_attention", "oracle_attention", "run",
    "run_case", "run_hop", "run_hop_case", "select", "tolerance",
]
