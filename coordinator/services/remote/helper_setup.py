"""The machine set-up operations of the remote helper (see ``helper.py``): what the
Python there is, unpacking the code, a virtualenv with this trialkeeper; and the small file
utilities both parts use.

Sent over SSH ahead of ``helper.py`` as one script, and run by the machine's own Python:
the standard library only and no syntax newer than Python 3.6.
"""

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

AGENT_MODULE = "trialkeeper.coordinator.services.remote.agent_main"


def op_probe(args):
    info = {
        "python": sys.executable,
        "version": list(sys.version_info[:3]),
        "home": os.path.expanduser("~"),
        "hostname": os.uname()[1],
        "platform": sys.platform,
        "proc": os.path.isdir("/proc/self"),
    }
    try:
        from trialkeeper import agent
        info["trialkeeper"] = getattr(agent, "__version__", "")
        info["protocol"] = getattr(agent, "PROTOCOL_VERSION", 0)
        info["trialkeeper_path"] = os.path.dirname(agent.__file__ or "")
        # The agent's dependencies: importing the session pulls in grpc, protobuf, psutil.
        import importlib
        importlib.import_module("trialkeeper.agent.session")
        importlib.import_module(AGENT_MODULE)
    except Exception as e:  # noqa: BLE001 - any failure to import is the answer
        info["import_error"] = f"{type(e).__name__}: {e}"
    return info


def op_extract(args):
    """Unpack a code archive into dest (once; concurrent callers are safe)."""
    dest = args["dest"]
    if os.path.isdir(dest):
        return {"extracted": False}
    parent = os.path.dirname(dest)
    _makedirs(parent)
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=parent)
    try:
        with tarfile.open(args["archive"], "r:gz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:
                for member in tar.getmembers():
                    if member.name.startswith("/") or ".." in member.name.split("/"):
                        raise ValueError("unsafe path in archive: " + member.name)
                tar.extractall(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isdir(dest):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return {"extracted": True}


def op_bootstrap(args):
    """A virtualenv with the uploaded trialkeeper wheel, seeing this Python's packages."""
    venv, wheel = args["venv"], args["wheel"]
    marker = os.path.join(venv, ".trialkeeper-wheel")
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(marker) and _read(marker) == os.path.basename(wheel):
        return {"python": python, "created": False}
    parent = os.path.dirname(venv)
    _makedirs(parent)
    tmp = tempfile.mkdtemp(prefix=".venv-", dir=parent)
    try:
        shutil.rmtree(tmp)
        # No pip: the wheel is pure Python and is unpacked directly, so no index is needed.
        run = subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", tmp],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120, check=False,
        )
        if run.returncode != 0:
            said = run.stdout.decode("utf-8", "replace")[-800:]
            return {"error": "python -m venv failed: " + said}
        tmp_python = os.path.join(tmp, "bin", "python")
        where = "print(os.path.relpath(sysconfig.get_paths()['purelib'], sys.prefix))"
        run = subprocess.run(
            [tmp_python, "-c", "import os, sys, sysconfig; " + where],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60, check=False,
        )
        if run.returncode != 0:
            said = run.stdout.decode("utf-8", "replace")[-800:]
            return {"error": "the new virtualenv's Python does not run: " + said}
        purelib_rel = run.stdout.decode().strip()
        tmp_purelib = os.path.join(tmp, purelib_rel)
        # The packages of the configured Python stay importable (its trialkeeper comes
        # after ours on sys.path): "dependencies present" means present for that Python.
        import site
        base = list(site.getsitepackages())
        if site.ENABLE_USER_SITE:
            base.append(site.getusersitepackages())
        _makedirs(tmp_purelib)
        with open(os.path.join(tmp_purelib, "_trialkeeper_base.pth"), "w") as f:
            f.write("\n".join(p for p in base if os.path.isdir(p)) + "\n")
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp_purelib)
        for name in os.listdir(tmp_purelib):
            if name.endswith(".dist-info"):
                with open(os.path.join(tmp_purelib, name, "INSTALLER"), "w") as f:
                    f.write("trialkeeper-bootstrap\n")
        with open(os.path.join(tmp, ".trialkeeper-wheel"), "w") as f:
            f.write(os.path.basename(wheel))
        if os.path.isdir(venv):
            shutil.rmtree(venv)
        # venv scripts name the venv's own path; it is moved into place before first use.
        os.rename(tmp, venv)
        _fix_venv_paths(venv, tmp)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return {"python": python, "created": True}


def _fix_venv_paths(venv, old):
    # pyvenv.cfg and activate scripts may name the temporary path; the interpreter finds
    # its venv from its own location, so only text files that mention it need fixing.
    for rel in ("pyvenv.cfg", "bin/activate", "bin/activate.csh", "bin/activate.fish"):
        path = os.path.join(venv, rel)
        try:
            text = _read(path)
        except OSError:
            continue
        if old in text:
            _write(path, text.replace(old, venv))


def _makedirs(path):
    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)


def _read(path):
    with open(path) as f:
        return f.read().strip()


def _write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
