"""A trial's copy of its working directory: what it left as copied goes once it ends."""

from __future__ import annotations

import os
from pathlib import Path

from trialkeeper.agent.codecopy import copy_tree as _copy_tree
from trialkeeper.agent.codecopy import prune_copy as _prune_copy


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_only_what_the_trial_wrote_or_changed_is_kept(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "data").mkdir()
    (src / "train.py").write_text("print('hi')\n")
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "pkg" / "deep" / "weights.bin").write_bytes(b"\0" * 4096)
    (src / "data" / "config.json").write_text("{}")
    (src / "link-to-pkg").symlink_to("pkg")
    (src / "link-to-train").symlink_to("train.py")
    copy = tmp_path / "trial" / "code"
    _copy_tree(src, copy)
    assert _tree(copy) == _tree(src)

    # What the trial does in its copy: writes outputs, changes a file, replaces a link.
    (copy / "out").mkdir()
    (copy / "out" / "model.pt").write_bytes(b"model")
    (copy / "pkg" / "log.txt").write_text("epoch 1\n")
    (copy / "data" / "config.json").write_text('{"changed": true}')
    (copy / "link-to-train").unlink()
    (copy / "link-to-train").symlink_to("pkg/mod.py")

    _prune_copy(src, copy)
    assert _tree(copy) == {"out", "out/model.pt", "pkg", "pkg/log.txt", "data", "data/config.json", "link-to-train"}
    assert (copy / "data" / "config.json").read_text() == '{"changed": true}'
    assert os.readlink(copy / "link-to-train") == "pkg/mod.py"
    assert _tree(src) == {"train.py", "pkg", "pkg/mod.py", "pkg/deep", "pkg/deep/weights.bin", "data",
                          "data/config.json", "link-to-pkg", "link-to-train"}, "the source is never touched"


def test_a_copy_left_as_it_was_goes_entirely(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f.txt").write_text("f")
    copy = tmp_path / "code"
    _copy_tree(src, copy)
    _prune_copy(src, copy)
    assert not copy.exists()
    _prune_copy(src, copy)  # nothing there: nothing to do, no error
