"""The `dflash` command line (cli/main.py).

Set here, before anything imports torch: on a machine without GPUs, OpenMP threads that wait for
work sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE; an explicit setting is kept). Spinning
teams of two processes on 2 busy cores trained at 62 tokens/s each, sleeping ones at 1,818 and
2,050; one train beside other agents' load ran at 485 tokens/s spinning and 2,185 sleeping.
Spawned workers inherit the setting.
"""

import os

if not any(os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/kfd")):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
