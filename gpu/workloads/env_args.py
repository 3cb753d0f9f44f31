#!/usr/bin/env python3
"""torch_loop.py with its options from $TORCH_LOOP_ARGS, for launchers whose own option parser
would take them (torchrun's argparse matches `--n` against its own `--nnodes`, …).

usage: TORCH_LOOP_ARGS="--n 300 --m 10" env_args.py OUT.json
"""
import os
import runpy
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.argv = ["torch_loop.py"] + shlex.split(os.environ.get("TORCH_LOOP_ARGS", "")) + sys.argv[1:]
runpy.run_path(os.path.join(HERE, "torch_loop.py"), run_name="__main__")
