#!/usr/bin/env python
"""The start-up abort's mechanism in one process: THREADS threads at a barrier each call llama.cpp's
``llama_print_system_info`` CALLS times, ``raw`` (the library's function: one static std::string
rebuilt in place, so concurrent calls corrupt the heap and glibc aborts the process) or ``locked``
(``tokenfuse.members.llamacpp_lib.system_info``, under ``LOAD_LOCK``). Exit status 0: no abort.

    for i in $(seq 20); do .venv/bin/python scripts/measure_system_info_race.py raw 3 2000 || echo abort; done
"""

import sys
import threading

import llama_cpp

from tokenfuse.members.llamacpp_lib import system_info

mode, n_threads, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
call = llama_cpp.llama_print_system_info if mode == "raw" else (lambda: system_info(llama_cpp))
go = threading.Barrier(n_threads)


def work() -> None:
    go.wait()
    for _ in range(calls):
        call()


threads = [threading.Thread(target=work) for _ in range(n_threads)]
for t in threads:
    t.start()
for t in threads:
    t.join()
