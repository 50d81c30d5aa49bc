"""`envelope-proxy`'s entry point (`proxy.cli.main`) as a shell user meets it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    # `envelope-proxy check policies | head -1`: once `head` exits, the command's next write
    # met a closed pipe and printed a BrokenPipeError traceback.
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: the first write fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "proxy", "check", "policies"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 1
