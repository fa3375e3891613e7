"""`vla-rl` with LeRobot's pi0/pi05 shrunk (`tiny_lerobot_vla.tiny_backbones`), for tests that run a
command as its own process: ``python tests/tiny_vla_cli.py serve ...``."""

import sys

from tiny_lerobot_vla import tiny_backbones

from vla_rl.cli import main

if __name__ == "__main__":
    with tiny_backbones():
        sys.exit(main(sys.argv[1:]))
