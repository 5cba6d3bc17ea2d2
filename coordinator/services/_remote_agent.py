"""The agent as the remote platform starts it: ``python -m trialkeeper.coordinator.services._remote_agent``.

It is ``trialkeeper agent`` with three differences that the SSH launch needs:

* the experiment token arrives on stdin (never argv, never a file) and is handed to the
  agent through its environment, which the agent clears before any trial starts;
* each trial runs in its own copy of the uploaded code (``<trial dir>/code``), made from
  the snapshot that ``StartTrial.working_directory`` names, so trials cannot disturb each
  other through the files they write (the seeds warn against a shared working directory);
* the exit status is written to ``--exit-file``, so the coordinator can tell a clean exit
  from a crash after the SSH session that started the agent is long gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

TRIAL_CODE_DIR = "code"


def _install_trial_copies() -> bool:
    """Make the agent's runner give each trial a copy of its working directory."""
    from trialkeeper.agent import runner, session

    base = runner.TrialRunner
    if not all(hasattr(base, name) for name in ("_run", "_prepare", "_end")):
        return False

    class CopyingTrialRunner(base):  # type: ignore[misc, valid-type]
        async def _run(self, t: Any) -> None:
            source = t.spec.working_directory
            if source:
                target = t.dir / TRIAL_CODE_DIR
                try:
                    await asyncio.to_thread(_copy_tree, Path(source).resolve(), target)
                except OSError as e:
                    self._end(t, "failed", None, 0, f"could not copy the code into {target}: {e}", False)
                    return
            await super()._run(t)

        def _prepare(self, t: Any) -> tuple[dict[str, str], str]:
            env, cwd = super()._prepare(t)
            if t.spec.working_directory:
                cwd = str(t.dir / TRIAL_CODE_DIR)
            return env, cwd

    session.TrialRunner = CopyingTrialRunner  # type: ignore[misc]
    return True


def _copy_tree(source: Path, target: Path) -> None:
    if not source.is_dir():
        raise FileNotFoundError(f"the uploaded code {source} is missing")
    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)


def main(argv: list[str]) -> int:
    exit_file: Path | None = None
    if len(argv) >= 2 and argv[0] == "--exit-file":
        exit_file, argv = Path(argv[1]), argv[2:]
    from trialkeeper.agent import main as agent_main

    token = sys.stdin.buffer.read().decode("utf-8").strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if token:
        os.environ[agent_main.TOKEN_ENV] = token
    code = 1
    try:
        if not _install_trial_copies():
            print("trialkeeper: this agent cannot copy code per trial; trials share the uploaded code", file=sys.stderr)
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
