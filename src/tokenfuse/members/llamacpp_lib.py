"""The llama.cpp library as the llama.cpp members use it: importing it, where its log lines go,
what its build has (AMX kernels), and how a model's weights are loaded.

``tokenfuse.members.llamacpp`` (the member) is the only user; kept apart so that file holds the
member's own work (contexts, the prefix cache, the decode calls).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from typing import Any

from tokenfuse.errors import ModelNotInstalledError

PIP_LLAMACPP = 'pip install "llama-cpp-python==0.3.36"'
# Members load in threads (``tokenfuse.load``), so every call into llama.cpp or llama-cpp-python that
# touches state of the whole process takes this lock:
# - model and context creation: llama-cpp-python silences llama.cpp while it loads by redirecting
#   the process's stdout/stderr file descriptors; two threads doing that at once leave them
#   pointing at /dev/null for good;
# - ``llama_print_system_info`` (``system_info``): it rebuilds one static std::string in place, so
#   two threads in it at once corrupt the heap and the process aborts (glibc's "munmap_chunk():
#   invalid pointer", "free(): invalid pointer", "double free or corruption"); each member's
#   build check (``amx_build``) called it from its loader thread;
# - the log callback (``route_logs``), set once per process.
LOAD_LOCK = threading.Lock()

log = logging.getLogger("tokenfuse.llama_cpp")
_log_callback = None  # the ctypes callback llama.cpp holds (kept alive here)
_last_level = logging.DEBUG
# ggml_log_level of this llama.cpp: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (continues the line)
GGML_LOG_ERROR, GGML_LOG_CONT = 4, 5


def import_llama_cpp():
    """The ``llama_cpp`` module, its log lines routed (``route_logs``); a clear error without it."""
    try:
        import llama_cpp
    except ImportError as err:
        raise ModelNotInstalledError(
            f"backend llamacpp needs llama-cpp-python (it compiles llama.cpp, a few minutes): {PIP_LLAMACPP}; "
            "or set `backend: transformers` for this member"
        ) from err
    route_logs(llama_cpp)
    return llama_cpp


def route_logs(llama_cpp) -> None:
    """Send llama.cpp's own log lines (context creation, the SWA cache notice, ...) to the Python
    logger ``tokenfuse.llama_cpp`` instead of stderr: errors at ERROR, everything else at DEBUG, so a
    terminal stays clean unless logging is turned up (``tokenfuse --verbose``, ``TOKENFUSE_LOG=debug``)."""
    global _log_callback
    with LOAD_LOCK:
        if _log_callback is None:
            _log_callback = _route(llama_cpp)


def _route(llama_cpp):
    """The callback, set in llama.cpp (the caller holds ``LOAD_LOCK``)."""

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, _user_data) -> None:
        global _last_level
        if level != GGML_LOG_CONT:
            _last_level = logging.ERROR if level == GGML_LOG_ERROR else logging.DEBUG
        if log.isEnabledFor(_last_level):
            log.log(_last_level, "%s", text.decode("utf-8", errors="replace").rstrip("\n"))

    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    return callback


def system_info(llama_cpp: Any) -> str:
    """``llama_print_system_info()``: the backends and CPU features of this build. The one caller of
    it in tokenfuse: it holds ``LOAD_LOCK``, since llama.cpp's function is not thread-safe (above)."""
    with LOAD_LOCK:
        return llama_cpp.llama_print_system_info().decode(errors="replace")


def amx_build(llama_cpp: Any) -> bool:
    """Whether this llama.cpp was built with its AMX kernels (x86 CPUs since Sapphire Rapids). Their
    matrix multiply crashes the process (segmentation fault) when two contexts decode at once, as an
    ensemble's members do. They are used only for weights loaded into llama.cpp's extra buffer types,
    so a member of such a build runs with ``exact_calls`` (weights as stored, and the cuts that make
    such weights' numbers independent of how ids are cut into calls; without them the prefix cache and
    speculative decoding would not be exact)."""
    return "AMX_INT8 = 1" in system_info(llama_cpp)


AMX_ADVICE = ("this llama.cpp build has AMX kernels, which crash when two members decode at once: its "
              "members run with exact_calls (weights as stored); to keep the faster default, rebuild "
              "llama-cpp-python without AMX by running scripts/setup.sh (it builds without AMX on x86 "
              "and replaces a build that has it)")

AMX_WARNED = threading.Event()  # the advice is logged once per process


def exact_calls_for_build(llama_cpp: Any, exact_calls: bool) -> bool:
    """``exact_calls`` as a member must run with it on this build: on when asked for, and on a build
    with AMX kernels (``amx_build``), which says so once per process (``AMX_ADVICE``)."""
    if exact_calls or not amx_build(llama_cpp):
        return exact_calls
    if not AMX_WARNED.is_set():
        AMX_WARNED.set()
        log.warning("%s", AMX_ADVICE)
    return True


@contextlib.contextmanager
def weights_as_stored(llama_cpp: Any, on: bool):
    """While ``on``, llama.cpp loads a model without repacking its weights for its faster kernels
    (``use_extra_bufts``; ``Llama`` has no parameter for it, so the default parameters it starts from
    are changed; callers hold ``LOAD_LOCK``)."""
    if not on:
        yield
        return
    lib = llama_cpp.llama_cpp
    default = lib.llama_model_default_params

    def stored():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = stored
    try:
        yield
    finally:
        lib.llama_model_default_params = default
