"""Checkpoints in object storage (agent/objectstore.py) against a real S3 API on 127.0.0.1:
moto's server (tests/s3server.py), which checks every request's signature.

The store finds its credentials and endpoint as it does in an agent: boto3's default chain,
from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_DEFAULT_REGION), with the user's own ~/.aws and the instance metadata service kept out.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from s3server import S3Server, s3_server  # noqa: F401 - s3_server: the fixture
from trialkeeper.agent import objectstore
from trialkeeper.agent.objectstore import MARKER, ObjectStore, ObjectStoreError, parse_url

MiB = 1024 * 1024


@pytest.fixture
def s3(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> S3Server:  # noqa: F811
    """The server, with this process's environment set as an agent's would be to reach it."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    _no_other_credentials(tmp_path, monkeypatch)
    return s3_server


def _no_other_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(name, raising=False)


def _checkpoint(directory: Path, *, big: int = 0) -> list[tuple[str, int]]:
    """A checkpoint's files in ``directory``: nested, one empty, ``big`` random bytes in one;
    the manifest: (relative path, size), sorted."""
    (directory / "model" / "layers").mkdir(parents=True)
    (directory / "optimizer").mkdir()
    (directory / "step.json").write_text('{"step": 3}')
    (directory / "model" / "layers" / "0.bin").write_bytes(os.urandom(4096))
    (directory / "model" / "empty").write_bytes(b"")
    (directory / "optimizer" / "state.pt").write_bytes(os.urandom(300))
    if big:
        with open(directory / "model" / "weights.bin", "wb") as f:
            f.writelines(os.urandom(MiB) for _ in range(big // MiB))
    return _manifest(directory)


def _manifest(directory: Path) -> list[tuple[str, int]]:
    return sorted((p.relative_to(directory).as_posix(), p.stat().st_size) for p in directory.rglob("*") if p.is_file())


def _digests(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in directory.rglob("*") if p.is_file()}


def test_a_directory_goes_up_and_comes_back_whole(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    files = _checkpoint(tmp_path / "live", big=20 * MiB)
    store = ObjectStore.from_url(f"s3://{bucket}/team/checkpoints/")

    url = store.put_dir(tmp_path / "live", "exp1/trial7/3", files)

    assert url == f"s3://{bucket}/team/checkpoints/exp1/trial7/3"
    stored = s3.keys(bucket)
    assert stored == {
        **{f"team/checkpoints/exp1/trial7/3/{path}": size for path, size in files},
        f"team/checkpoints/exp1/trial7/3/{MARKER}": stored[f"team/checkpoints/exp1/trial7/3/{MARKER}"],
    }
    assert stored["team/checkpoints/exp1/trial7/3/model/weights.bin"] == 20 * MiB
    big = s3.client().head_object(Bucket=bucket, Key="team/checkpoints/exp1/trial7/3/model/weights.bin")
    assert big["ETag"].strip('"').endswith("-3")  # went up in three parts of 8 MiB, not in one piece
    # Another machine's agent, with a store made from the same setting, gets the same files.
    ObjectStore.from_url(f"s3://{bucket}/team/checkpoints").get_dir(url, tmp_path / "continued", files)
    assert _digests(tmp_path / "continued") == _digests(tmp_path / "live")
    assert _manifest(tmp_path / "continued") == files
    # A checkpoint of no files is a directory with its marker alone, and comes back as an empty one.
    (tmp_path / "nothing").mkdir()
    empty = store.put_dir(tmp_path / "nothing", "exp1/trial7/4", [])
    assert [k for k in s3.keys(bucket) if k.startswith("team/checkpoints/exp1/trial7/4/")] == [
        f"team/checkpoints/exp1/trial7/4/{MARKER}"
    ]
    store.get_dir(empty, tmp_path / "continued-empty", [])
    assert list((tmp_path / "continued-empty").iterdir()) == []
    # A bucket's top works as the prefix too.
    top = ObjectStore.from_url(f"s3://{bucket}")
    assert top.put_dir(tmp_path / "live", "e/t/1", [("step.json", 11)]) == f"s3://{bucket}/e/t/1"
    assert s3.keys(bucket, "e/") == {"e/t/1/step.json": 11, f"e/t/1/{MARKER}": s3.keys(bucket, "e/")[f"e/t/1/{MARKER}"]}


def test_an_upload_that_stops_half_way_leaves_an_incomplete_directory_that_is_refused(
    s3: S3Server, tmp_path: Path
) -> None:
    bucket = s3.new_bucket()
    live = tmp_path / "live"
    files = _checkpoint(live)
    store = ObjectStore.from_url(f"s3://{bucket}/ck")
    url = store.put_dir(live, "e/t/5", files)
    # Again at the same key: a "file" that cannot be read (a directory of the listed size)
    # stops the upload after the files before it went up.
    (live / "zz").mkdir()
    broken = [*files, ("zz", (live / "zz").stat().st_size)]

    with pytest.raises(ObjectStoreError) as failed:
        store.put_dir(live, "e/t/5", broken)

    assert str(failed.value) == f"s3://{bucket}/ck/e/t/5/zz: upload of {live / 'zz'} failed: Is a directory"
    assert f"ck/e/t/5/{MARKER}" not in s3.keys(bucket)  # the earlier marker was taken away first
    with pytest.raises(ObjectStoreError, match="is incomplete: it has no .complete marker") as refused:
        store.get_dir(url, tmp_path / "continued", files)
    assert url in str(refused.value)
    assert not (tmp_path / "continued").exists()


def test_a_directory_without_its_marker_is_refused(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    files = _checkpoint(tmp_path / "live")
    store = ObjectStore.from_url(f"s3://{bucket}/ck")
    url = store.put_dir(tmp_path / "live", "e/t/2", files)
    s3.client().delete_object(Bucket=bucket, Key=f"ck/e/t/2/{MARKER}")

    with pytest.raises(ObjectStoreError) as refused:
        store.get_dir(url, tmp_path / "continued", files)

    assert str(refused.value) == (
        f"{url} is incomplete: it has no {MARKER} marker (its upload did not finish, or it was deleted)"
    )
    assert not (tmp_path / "continued").exists()
    with pytest.raises(ObjectStoreError, match="is incomplete"):  # and a step never uploaded at all
        store.get_dir(f"s3://{bucket}/ck/e/t/9", tmp_path / "continued", files)


def test_a_file_of_another_size_than_recorded_is_refused(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    files = _checkpoint(tmp_path / "live")
    store = ObjectStore.from_url(f"s3://{bucket}/ck")
    url = store.put_dir(tmp_path / "live", "e/t/4", files)

    # The record says one size, storage holds another.
    recorded = [(p, s + 1 if p == "step.json" else s) for p, s in files]
    with pytest.raises(ObjectStoreError) as refused:
        store.get_dir(url, tmp_path / "a", recorded)
    assert str(refused.value) == f"{url}: step.json has 11 bytes in storage, 12 expected"
    assert not (tmp_path / "a").exists()

    # A file the record lists that storage lacks.
    with pytest.raises(ObjectStoreError) as refused:
        store.get_dir(url, tmp_path / "b", [*files, ("zextra.bin", 3)])
    assert str(refused.value) == f"{url}: zextra.bin is missing from storage"

    # Storage changed behind the record's back.
    s3.client().put_object(Bucket=bucket, Key="ck/e/t/4/optimizer/state.pt", Body=b"short")
    with pytest.raises(ObjectStoreError) as refused:
        store.get_dir(url, tmp_path / "c", files)
    assert str(refused.value) == f"{url}: optimizer/state.pt has 5 bytes in storage, 300 expected"
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_a_file_that_changed_since_it_was_listed_is_not_uploaded(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    files = _checkpoint(tmp_path / "live")
    (tmp_path / "live" / "step.json").write_text('{"step": 30}')
    store = ObjectStore.from_url(f"s3://{bucket}/ck")

    with pytest.raises(ObjectStoreError, match=r"step.json has 12 bytes, 11 were listed: it changed"):
        store.put_dir(tmp_path / "live", "e/t/1", files)
    assert s3.keys(bucket) == {}


def test_delete_removes_one_step_and_nothing_beside_it(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    files = _checkpoint(tmp_path / "live")
    store = ObjectStore.from_url(f"s3://{bucket}/ck")
    one = store.put_dir(tmp_path / "live", "e/t/1", files)
    ten = store.put_dir(tmp_path / "live", "e/t/10", files)  # "1" is a prefix of "10" as a string

    ObjectStore.from_url(one).delete(one)  # what the coordinator calls for a checkpoint it drops

    assert not any(k.startswith("ck/e/t/1/") for k in s3.keys(bucket))
    assert len([k for k in s3.keys(bucket) if k.startswith("ck/e/t/10/")]) == len(files) + 1
    with pytest.raises(ObjectStoreError, match="is incomplete"):
        store.get_dir(one, tmp_path / "gone", files)
    store.get_dir(ten, tmp_path / "kept", files)
    assert _digests(tmp_path / "kept") == _digests(tmp_path / "live")
    store.delete(one)  # already gone: no error
    with pytest.raises(ObjectStoreError, match="names a whole bucket; refusing to delete everything in it"):
        store.delete(f"s3://{bucket}/")
    assert len(s3.keys(bucket)) == len(files) + 1


def test_delete_and_download_go_through_many_pages_of_a_listing(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pages of 3 keys and deletes of 3 keys a request (S3's own limits are 1000), so that a
    # handful of files takes several of each.
    monkeypatch.setattr(objectstore, "LIST_PAGE", 3)
    monkeypatch.setattr(objectstore, "DELETE_BATCH", 3)
    bucket = s3.new_bucket()
    live = tmp_path / "live"
    live.mkdir()
    for i in range(10):
        (live / f"{i:02d}").write_bytes(b"x" * i)
    files = _manifest(live)
    store = ObjectStore.from_url(f"s3://{bucket}/ck")
    url = store.put_dir(live, "e/t/1", files)
    assert len(s3.keys(bucket)) == 11

    store.get_dir(url, tmp_path / "continued", files)
    assert _digests(tmp_path / "continued") == _digests(live)
    store.delete(url)
    assert s3.keys(bucket) == {}


def test_a_bucket_that_does_not_exist_is_named(s3: S3Server, tmp_path: Path) -> None:
    files = _checkpoint(tmp_path / "live")
    store = ObjectStore.from_url("s3://no-such-bucket-here/ck")
    nowhere = "bucket 'no-such-bucket-here' does not exist (NoSuchBucket: The specified bucket does not exist)"

    with pytest.raises(ObjectStoreError) as up:
        store.put_dir(tmp_path / "live", "e/t/1", files)
    with pytest.raises(ObjectStoreError) as down:
        store.get_dir("s3://no-such-bucket-here/ck/e/t/1", tmp_path / "continued", files)
    with pytest.raises(ObjectStoreError) as deleting:
        store.delete("s3://no-such-bucket-here/ck/e/t/1")

    assert str(up.value).startswith("s3://no-such-bucket-here/ck/e/t/1: ")
    for error in (up, down, deleting):
        assert str(error.value).startswith("s3://no-such-bucket-here/ck/e/t/1"), error.value
        assert nowhere in str(error.value)


@pytest.mark.parametrize("wrong", ["secret", "key id"])
def test_refused_credentials_are_said_so_without_any_secret(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: str
) -> None:
    bucket = s3.new_bucket()
    files = _checkpoint(tmp_path / "live")
    url = ObjectStore.from_url(f"s3://{bucket}/ck").put_dir(tmp_path / "live", "e/t/1", files)
    bad_secret = "wRoNg/" + "s" * 34
    bad_key_id = "AKIAZZZZZZZZZZZZZZZZ"
    if wrong == "secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", bad_secret)
        code = "SignatureDoesNotMatch"
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", bad_key_id)
        code = "InvalidAccessKeyId"
    store = ObjectStore.from_url(f"s3://{bucket}/ck")

    errors = []
    for attempt in (
        lambda: store.put_dir(tmp_path / "live", "e/t/2", files),
        lambda: store.get_dir(url, tmp_path / "continued", files),
        lambda: store.delete(url),
    ):
        with pytest.raises(ObjectStoreError) as refused:
            attempt()
        errors.append(str(refused.value))

    for message in errors:
        assert message.startswith(f"s3://{bucket}/ck/e/t/"), message
        assert f"the credentials were refused: {code}" in message
        assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message
        for secret in (bad_secret, bad_key_id, s3.secret_access_key, s3.access_key_id, "Signature=", "Credential="):
            assert secret not in message
    assert len(s3.keys(bucket)) == len(files) + 1  # nothing written, nothing deleted


def test_no_credentials_at_all_is_said_so(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3.new_bucket()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    files = _checkpoint(tmp_path / "live")

    with pytest.raises(ObjectStoreError) as refused:
        ObjectStore.from_url(f"s3://{bucket}/ck").put_dir(tmp_path / "live", "e/t/1", files)

    assert str(refused.value).startswith(f"s3://{bucket}/ck/e/t/1: ")
    assert "no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in str(refused.value)


def test_an_endpoint_nobody_listens_on_fails_within_the_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_other_credentials(tmp_path, monkeypatch)
    with socket.socket() as s:  # a port of ours that listens to nobody: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE00")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "example-secret-example-secret-example-00")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        store = ObjectStore.from_url("s3://bucket/ck", connect_timeout=2, read_timeout=2, max_attempts=2)
        with pytest.raises(ObjectStoreError) as failed:
            store.delete("s3://bucket/ck/e/t/1")

    message = str(failed.value)
    assert message.startswith("s3://bucket/ck/e/t/1/.complete: deleting failed: EndpointConnectionError")
    assert f"127.0.0.1:{port}" in message
    assert "example-secret" not in message and "AKIAEXAMPLE" not in message


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("bucket/prefix", "must start with s3://"),
        ("s3:///prefix", "'' is not a bucket name"),
        ("s3://bucket/a/../b", "'a/../b' is not a relative path of plain names"),
        ("s3://bucket/a//b", "'a//b' is not a relative path of plain names"),
        ("s3://bucket/a?versionId=1", "has a character an S3 key here may not hold"),
    ],
)
def test_a_bad_url_is_named(url: str, problem: str) -> None:
    with pytest.raises(ObjectStoreError) as refused:
        ObjectStore.from_url(url)
    assert str(refused.value).startswith(f"object storage URL {url!r}: {problem}")


def test_the_prefix_of_a_url() -> None:
    assert parse_url("s3://b") == ("b", "")
    assert parse_url("s3://b/") == ("b", "")
    assert parse_url("s3://b/x/y/") == ("b", "x/y")


def test_a_path_that_leaves_the_directory_is_refused_before_any_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_other_credentials(tmp_path, monkeypatch)  # and no server: a request would fail differently
    store = ObjectStore.from_url("s3://bucket/ck", connect_timeout=1, read_timeout=1, max_attempts=1)
    for path, problem in [
        ("../outside", "'../outside' is not a relative path of plain names"),
        ("/etc/passwd", "'/etc/passwd' is not a relative path of plain names"),
        (MARKER, "a file may not be named .complete"),
    ]:
        with pytest.raises(ObjectStoreError, match=problem.replace(".", r"\.")):
            store.get_dir("s3://bucket/ck/e/t/1", tmp_path / "continued", [(path, 1)])
        with pytest.raises(ObjectStoreError, match=problem.replace(".", r"\.")):
            store.put_dir(tmp_path, "e/t/1", [(path, 1)])
    with pytest.raises(ObjectStoreError, match="'../t/1' is not a relative path"):
        store.put_dir(tmp_path, "../t/1", [])


_WITHOUT_BOTO3 = textwrap.dedent(
    """
    import sys
    sys.modules["boto3"] = None  # `import boto3` now raises ImportError, as where it is not installed
    sys.modules["botocore"] = None
    from trialkeeper.agent.objectstore import ObjectStore, ObjectStoreError
    try:
        ObjectStore.from_url("s3://bucket/prefix")
    except ObjectStoreError as e:
        print(e)
    else:
        print("no error")
    """
)


def test_without_boto3_the_error_says_what_to_install() -> None:
    out = subprocess.run([sys.executable, "-c", _WITHOUT_BOTO3], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "checkpoints in object storage (s3://bucket/prefix) need boto3, which is not installed here: "
        "pip install 'trialkeeper[s3]'"
    )
