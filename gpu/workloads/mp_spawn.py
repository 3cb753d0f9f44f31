#!/usr/bin/env python3
"""torch_loop.py in a `multiprocessing` worker started with the `spawn` method: the parent never
touches CUDA; the worker (a fresh interpreter, a child of the parent) does all of it and writes
the same JSON as torch_loop.py (its own pid in it).

usage: mp_spawn.py [torch_loop.py arguments...] OUT.json
"""
import multiprocessing as mp
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(argv):
    sys.argv = argv
    runpy.run_path(os.path.join(HERE, "torch_loop.py"), run_name="__main__")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=worker, args=(["torch_loop.py"] + sys.argv[1:],))
    p.start()
    p.join()
    sys.exit(p.exitcode or 0)
