"""The agent as the remote platform starts it: ``python -m trialkeeper.coordinator.services.remote.agent_main``.

It is ``trialkeeper agent`` with these differences that the SSH launch needs:

* the experiment token arrives on stdin (never argv, never a file) and is handed to the
  agent through its environment, which the agent clears before any trial starts;
* each trial runs in its own copy of the uploaded code (the agent's
  ``--copy-working-directory``, which the remote service passes);
* the exit status is written to ``--exit-file``, so the coordinator can tell a clean exit
  from a crash after the SSH session that started the agent is long gone.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    exit_file: Path | None = None
    if len(argv) >= 2 and argv[0] == "--exit-file":
        exit_file, argv = Path(argv[1]), argv[2:]
    from trialkeeper.agent import main as agent_main
    from trialkeeper.protos.wire import TOKEN_ENV

    token = sys.stdin.buffer.read().decode("utf-8").strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if token:
        os.environ[TOKEN_ENV] = token
    code = 1
    try:
        code = agent_main.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - recorded for the coordinator, then re-raised as a status
        traceback.print_exc()
        code = 1
    finally:
        if exit_file is not None:
            tmp = exit_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"code": code}))
            os.replace(tmp, exit_file)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
