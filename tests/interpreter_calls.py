"""Triton's interpreter (TRITON_INTERPRET=1) without its second patching of triton.language at
each call of a @triton.jit helper.

A kernel's launch under the interpreter replaces the builtins of the triton.language modules its
globals name by interpreted ones, and puts them back when the grid is done. Each call of a jit
helper inside the kernel (strata's kernels call several a program: enter, _codes, gate_act...)
patches again: it scans every member of those modules (inspect.getmembers), finds nothing left
to replace where the kernel did it already, and costs about 2 ms. That was a fifth of the
interpreter's time in tests/kernels/test_batch_invariance.py's whole-stage case. patch_once
skips the scan where every triton.language module of the helper's globals is already the
interpreter's; a helper whose module names one the kernel's did not is patched as before. The
language the kernels see is the same; only the repeated work goes.

Triton's own checks stay: among them, every integer add, subtract and multiply is checked for
overflow under the interpreter.
"""
from __future__ import annotations

import inspect


def patch_once() -> bool:
    """Install the shortcut in triton.runtime.interpreter; False (nothing changed) where this
    Triton has no _patch_lang to wrap."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope is None or getattr(original, "strata_once", False):
        return False

    def patched(lang) -> bool:
        """Whether the interpreter's builtins stand in `lang` now (tl.load is a builtin until
        it is replaced)."""
        return not tl.core.is_builtin(getattr(lang, "load", None))

    def _patch_lang(fn):
        langs = [v for v in fn.__globals__.values()
                 if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and all(patched(lang) for lang in langs):
            return scope()          # nothing to restore: the kernel's launch restores it
        return original(fn)

    _patch_lang.strata_once = True
    interpreter._patch_lang = _patch_lang
    return True
