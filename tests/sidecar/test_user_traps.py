"""Traps a new user walked into with the sidecar: shared notify sockets, slow stops, unsupported schemes, a
segment folder that does not exist, a fallback no flag exposed, no ``--version``, docs naming wrong labels."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from modelload.loader.cli.main import main
from modelload.loader.errors import ConfigError, ModelloadError, SourceNotFoundError, SourceUriError
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.metrics import MetricsObserver
from modelload.sidecar.notify import Notifier
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.settings import parse_settings
from modelload.sidecar.sources import HttpSettings, RetryPolicy, S3Settings, SourceSettings
from tests.sidecar import models
from tests.support import hfdir
from tests.support.ports import free_port
from tests.support.sidecars import Sidecars
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
FAST = SourceSettings(
    http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0),
    retry=RetryPolicy(attempts=2, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=10.0),
)


def load(source: str, segment: Path, *, sources: SourceSettings = FAST, **settings: Any) -> None:
    Engine(
        LoadSettings(source=source, segment=segment, **settings), sources=sources, observer=LoadTracker()
    ).run()


def test_two_segments_in_one_folder_get_two_notify_sockets_and_stopping_one_keeps_the_other(
    shm_dir: Path,
) -> None:
    endpoints = [
        parse_settings(["--source", "/m.bin", "--segment", str(shm_dir / name)], environ={}).notify.endpoint
        for name in ("a.seg", "b.seg")
    ]
    assert endpoints == [f"ipc://{shm_dir}/a.seg.notify.sock", f"ipc://{shm_dir}/b.seg.notify.sock"]
    first, second = (Notifier(endpoint) for endpoint in endpoints if endpoint is not None)
    first.close()
    assert (shm_dir / "b.seg.notify.sock").is_socket()
    second.close()


def test_a_second_publisher_on_a_live_socket_is_refused_instead_of_taking_it(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/shared.sock"
    with Notifier(endpoint):
        with pytest.raises(ConfigError, match="another process publishes notifications on ipc://") as clash:
            Notifier(endpoint)
        assert (shm_dir / "shared.sock").is_socket()
    # The advice never leads two sidecars onto one segment (each with its own --notify): that is refused.
    assert "never share one segment" in str(clash.value)
    assert "or its own segment path" not in str(clash.value)


def test_a_missing_segment_folder_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-volume" / "model.seg"
    status = main(["sidecar", "--source", str(tmp_path / "m.bin"), "--segment", str(missing), "--port", "0"])
    err = capsys.readouterr().err
    assert status == 2
    assert f"the segment's folder {missing.parent} does not exist" in err
    assert "notif" not in err


@pytest.mark.timeout(20)  # before the fix the sidecar served its failure forever
def test_a_segment_path_that_is_a_folder_exits_at_once_naming_a_file_to_create_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before the fix the load failed with "... is not a file (a directory?); a segment cannot replace it:
    # remove it" (advice to delete what may be the volume) and the sidecar served that failure forever
    volume = tmp_path / "volume"
    volume.mkdir()
    status = main(["sidecar", "--source", str(tmp_path / "m.bin"), "--segment", str(volume), "--port", "0"])
    err = capsys.readouterr().err
    assert status == 2
    assert f"{volume} is a directory: name the segment file to create in it ({volume}/model.seg" in err
    assert "remove it" not in err and volume.is_dir()


@pytest.mark.timeout(20)  # before the fix the sidecar served its failure forever
def test_an_unsupported_scheme_exits_at_once_with_a_config_error(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        ["sidecar", "--source", "ftp://host/m.bin", "--segment", str(shm_dir / "m.seg"), "--port", "0"]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert "no source for ftp:// URIs (supported: " in err
    assert all(f"{scheme}://" in err for scheme in ("az", "file", "gs", "hf", "http", "https", "oci", "s3"))
    # (that production lists no memory:// is checked in a fresh process: tests here register it)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("source", ["s3:/bucket/model/", "https:/host/m.safetensors", "s3:bucket/m"])
def test_a_uri_missing_a_slash_is_named_as_such_instead_of_read_as_a_local_path(
    source: str, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before the fix "s3:/bucket/model/" was a local path: the load failed with "no file at s3:/bucket/model/:
    # check the path and the volume mount", and the sidecar served that failure instead of exiting
    status = main(["sidecar", "--source", source, "--segment", str(shm_dir / "m.seg"), "--port", "0"])
    err = capsys.readouterr().err
    scheme = source.split(":", 1)[0]
    assert status == 2
    assert f"{source!r} is not a {scheme}:// URI" in err and f"{scheme}://" in err


def test_a_stop_during_connection_retries_is_prompt(
    shm_dir: Path, sidecars: Sidecars, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelload.sidecar.sources import _retry

    cut_short = threading.Event()
    pause = _retry._pause

    def watched(policy: RetryPolicy, delay: float, uri: str) -> None:
        try:
            pause(policy, delay, uri)
        except _retry.RetryCancelled:
            cut_short.set()
            raise

    monkeypatch.setattr(_retry, "_pause", watched)
    closed = free_port()  # nothing listens: every connect is refused and retried with backoff
    sidecar = sidecars.start(f"http://127.0.0.1:{closed}/m.safetensors", shm_dir / "model.seg")
    try:
        # by the fifth retry the next wait is 1.6-3.2 s (0.2 s doubled four times, then shortened by jitter)
        wait_for(lambda: sidecar.tracker.snapshot().retries >= 5, timeout=30, what="five retries")
    finally:
        status = sidecar.stop()
    assert status == 1
    assert cut_short.is_set()  # the wait before the next retry ended with the stop, not with its delay
    snapshot = sidecar.tracker.snapshot()
    assert snapshot.phase == "stopped"
    assert not (shm_dir / "model.seg.failed").exists()  # a stop: a restart loads again, apps wait for it


def test_the_range_fallback_has_a_flag_and_a_variable() -> None:
    source = ["--source", "http://127.0.0.1:9/m.bin"]
    assert parse_settings(source, environ={}).sources.http.range_fallback is False
    assert parse_settings([*source, "--range-fallback"], environ={}).sources.http.range_fallback is True
    env = {"MODELLOAD_RANGE_FALLBACK": "true"}
    assert parse_settings(source, environ=env).sources.http.range_fallback is True
    assert parse_settings([*source, "--no-range-fallback"], environ=env).sources.http.range_fallback is False


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"modelload {version('modelload')}"


def test_the_docs_name_the_metrics_and_labels_the_sidecar_exports() -> None:
    observer = MetricsObserver()
    observer.load_started(source="s3://b/k", segment="/run/modelload/model.seg")
    observer.retried(kind="connection", message="reset")
    observer.load_failed(kind="not_found", reason="gone")
    exported: dict[str, set[str]] = {}
    for line in generate_latest(observer.registry).decode().splitlines():
        match = re.match(r"^(modelload_\w+?)(?:\{([^}]*)\})? ", line)
        if match and not match.group(1).endswith("_created"):  # creation stamps, not families
            labels = {pair.split("=")[0] for pair in (match.group(2) or "").split(",") if pair}
            exported.setdefault(match.group(1), set()).update(labels - {"le"})
    row = next(
        line for line in (REPO / "docs/sidecar.md").read_text().splitlines() if "`GET /metrics`" in line
    )
    documented = re.findall(r"`(modelload_\w+)(?:\{(\w+)\})?`", row)
    assert documented, "the docs' /metrics row names no metric"
    for name, label in documented:
        family = name if name in exported else f"{name}_bucket"
        assert family in exported, f"docs/sidecar.md names {name}, which the sidecar does not export"
        assert ({label} if label else set()) == exported[family], f"{name}: docs say {{{label}}}"
    families = {name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for name in exported}
    assert families <= {name for name, _ in documented}, "a family the docs do not list"


def test_the_docs_status_row_names_every_key_the_sidecar_answers_and_no_other() -> None:
    answered = set(LoadTracker().snapshot().as_dict())
    row = next(
        line for line in (REPO / "docs/sidecar.md").read_text().splitlines() if "`GET /status`" in line
    )
    documented = set(re.findall(r"`(\w+)`", row))
    assert answered - documented == set(), "keys /status answers that the docs do not name"
    assert documented - answered == set(), "keys the docs name that /status does not answer"


def test_the_sidecar_docs_flag_table_names_every_flag_with_its_variable() -> None:
    from modelload.sidecar.logs import add_log_format  # noqa: F401 - --log-format is added beside OPTIONS
    from modelload.sidecar.settings import OPTIONS

    doc = (REPO / "docs/sidecar.md").read_text()
    table = doc[doc.index("## Flags") : doc.index("\n## ", doc.index("## Flags") + 1)]
    rows = [line for line in table.splitlines() if line.startswith("| `--")]
    documented = {flag: row for row in rows for flag in re.findall(r"`(--[a-z0-9-]+)", row.split("|")[1])}
    for option in OPTIONS:
        assert option.flag in documented, f"docs/sidecar.md's flag table lacks {option.flag}"
        variables = documented[option.flag].split("|")[2]
        family = "*`" in variables and option.env.startswith(variables.strip(" `*"))  # MODELLOAD_PEER*
        named = option.env in variables or family
        assert named, f"{option.flag}: the table names another variable"
    source = next(row for row in rows if row.startswith("| `--source"))
    for scheme in ("s3://", "gs://", "az://", "hf://", "oci://", "http(s)://", "file://"):
        assert scheme in source, f"the --source row does not name {scheme}"


def test_the_sidecar_help_names_every_source_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sidecar", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    options = text[text.index("options:") :]
    source_help = options[options.index("--source URI") : options.index("--segment PATH")]
    for scheme in ("s3://", "gs://", "az://", "hf://", "oci://", "http(s)://", "file://"):
        assert scheme in source_help, f"--source's help does not name {scheme}"
    description = text[: text.index("HTTP endpoints")]
    for store in ("S3", "Google Cloud Storage", "Azure Blob", "Hugging Face Hub", "OCI registr"):
        assert store in description, f"the sidecar's description does not name {store}"


# --- URI slips and missing files (issue: a new user's traps) ---------------------------------------------


@pytest.mark.timeout(20)
def test_a_uri_missing_its_colon_is_named_as_such_instead_of_read_as_a_local_path(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        ["sidecar", "--source", "s3//models/llama/", "--segment", str(shm_dir / "m.seg"), "--port", "0"]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert "'s3//models/llama/' is not a s3:// URI" in err and "did you mean s3://models/llama/?" in err


def test_an_http_directory_without_its_slash_is_named_a_directory_not_a_refused_token(
    nginx: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=80, layers=1)
    for name, data in hfdir.files(tensors, shards=1, small={"config.json": b"{}"}).items():
        nginx.put(f"slips/tiny/{name}", data)
    source = nginx.url("slips/tiny")
    with pytest.raises(SourceUriError) as slip:
        load(source, shm_dir / "model.seg")
    message = str(slip.value)
    assert f"{source} names a directory" in message and f"({source}/)" in message
    assert "token" not in message
    load(source + "/", shm_dir / "model.seg")  # as the message says
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_an_s3_prefix_without_its_slash_says_the_prefix_holds_a_model(
    moto_s3: Any, aws_env: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=81, layers=1)
    for name, data in hfdir.files(tensors, shards=2, small={"config.json": b"{}"}).items():
        moto_s3.put("slips", f"llama/{name}", data)
    sources = SourceSettings(s3=S3Settings(endpoint_url=moto_s3.endpoint, addressing="path"))
    with pytest.raises(SourceNotFoundError) as slip:
        load("s3://slips/llama", shm_dir / "model.seg", sources=sources)
    message = str(slip.value)
    assert "no object 'llama'" in message and "but s3://slips/llama/ is a directory holding" in message
    assert "model-00001-of-00002.safetensors" in message
    assert "end the source with '/'" in message
    with pytest.raises(SourceNotFoundError) as plain:  # a name that is nothing at all gets no hint
        load("s3://slips/nothing", shm_dir / "model.seg", sources=sources)
    assert "directory" not in str(plain.value)


def test_files_named_on_a_base_without_its_slash_are_refused_not_appended_to_its_last_segment(
    nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    with pytest.raises(SourceUriError, match="must end with '/'"):
        load(nginx_proxy.url("slips/tiny"), shm_dir / "model.seg", files=("x.safetensors",))
    assert not any("tinyx" in r.path for r in nginx_proxy.requests), "no request for '.../tinyx.safetensors'"


@pytest.mark.parametrize("flag", ["--key-file", "--password-file"])
def test_a_missing_key_file_stops_the_sidecar_at_start_naming_the_flag(
    flag: str, tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "secrets" / "key"
    argv = ["sidecar", "--source", "s3://models/m.tensors", "--segment", str(shm_dir / "m.seg")]
    status = main([*argv, "--port", "0", flag, str(missing)])
    err = capsys.readouterr().err
    assert status == 2
    assert flag in err and f"{missing}: it does not exist" in err and "mount the Secret" in err
    assert "Traceback" not in err and "Errno" not in err
    assert not (shm_dir / "m.seg.failed").exists(), "refused at start: no load was tried"


def test_a_passphrase_in_the_key_file_stops_the_sidecar_at_start(
    tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "key"
    key.write_bytes(b"correct horse battery staple\n")
    argv = ["sidecar", "--source", "s3://models/m.tensors", "--segment", str(shm_dir / "m.seg")]
    assert main([*argv, "--port", "0", "--key-file", str(key)]) == 2
    err = capsys.readouterr().err
    assert "--key-file/MODELLOAD_KEY_FILE" in err and "exactly 32 bytes" in err
    assert "correct horse" not in err


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "source", ["S3://models/llama/", "File:///models/llama/", "HTTPS://host/m.safetensors"]
)
def test_a_scheme_in_capitals_is_refused_with_the_uri_in_lower_case_not_read_as_another_uri(
    source: str, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before the fix "S3://models/llama/" failed as access denied to "s3://S3://models/llama/", and
    # "File:///models/llama/" as a missing local file of that name, while HTTPS:// loaded
    status = main(["sidecar", "--source", source, "--segment", str(shm_dir / "m.seg"), "--port", "0"])
    err = capsys.readouterr().err
    scheme, _, rest = source.partition("://")
    assert status == 2
    assert f"did you mean {scheme.lower()}://{rest}?" in err and "lower case" in err


def test_a_local_file_s_proof_in_the_status_names_its_size_and_mtime_not_an_etag(shm_dir: Path) -> None:
    # before the fix /status said "its version (ETag or generation) pinned on every range" for a local file
    source = shm_dir / "local.safetensors"
    source.write_bytes(models.safetensors_bytes(models.state_dict(layers=1, width=16)))
    tracker = LoadTracker()
    Engine(
        LoadSettings(source=str(source), segment=shm_dir / "local.seg"), sources=FAST, observer=tracker
    ).run()
    (proof,) = tracker.snapshot().as_dict()["proofs"].values()  # type: ignore[union-attr]
    assert "size and modification time" in proof["proof"] and "ETag" not in proof["proof"]


@pytest.mark.parametrize(
    ("kind", "said"), [("transient", "(transient)"), ("connection", "(connection; transient)")]
)
def test_a_retried_attempt_is_logged_with_its_kind_once(
    kind: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    # before the fix an attempt that gave up after its retries was logged "failed (transient; transient)"
    from modelload.sidecar.logs import LoggingObserver

    with caplog.at_level(logging.WARNING, logger="modelload"):
        LoggingObserver().load_retrying(kind=kind, reason="gave up", attempt=1, delay=5.0)
    assert f"load attempt 1 failed {said}: gave up" in caplog.text


def test_a_model_dir_naming_a_folder_of_other_files_fails_the_load_and_deletes_nothing(
    tmp_path: Path, shm_dir: Path
) -> None:
    # before the fix --model-dir $HOME (or the source folder itself) was replaced whole by the model's
    # small files: everything in it was deleted, and the load went on
    source = tmp_path / "llama"
    source.mkdir()
    (source / "model.safetensors").write_bytes(
        models.safetensors_bytes(models.state_dict(layers=1, width=16))
    )
    (source / "config.json").write_text("{}")
    home = tmp_path / "home"
    (home / "projects").mkdir(parents=True)
    (home / "notes.txt").write_text("mine")
    for folder in (home, source):
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        with pytest.raises(ConfigError, match=f"the model directory {folder} already holds files"):
            load(f"{source}/", shm_dir / "m.seg", model_dir=folder)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (home / "notes.txt").read_text() == "mine"


@pytest.mark.timeout(20)  # before the fix the sidecar went on with its load and served it forever
@pytest.mark.parametrize("what", ["the model file itself", "another file"])
def test_a_segment_path_naming_a_file_that_is_no_segment_is_refused_and_the_file_kept(
    what: str, tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before the fix the sidecar set any file at the segment path aside as "an unreadable segment" and
    # deleted it: --segment naming the source deleted the model, then failed with "no file at ..."
    source = tmp_path / "model.safetensors"
    source.write_bytes(models.safetensors_bytes(models.state_dict(layers=1, width=16)))
    target = source if what == "the model file itself" else shm_dir / "notes.txt"
    if target != source:
        target.write_text("mine")
    before = target.read_bytes()
    status = main(["sidecar", "--source", str(source), "--segment", str(target), "--port", "0"])
    err = capsys.readouterr().err
    assert status == 2
    assert f"{target} exists and is not a modelload segment" in err
    assert target.read_bytes() == before


def test_a_proxy_that_is_down_is_named_not_the_origin_behind_it(shm_dir: Path) -> None:
    # before the fix: "cannot connect to 127.0.0.1:9: ConnectionRefusedError", the origin, although the
    # connection refused was the one to the proxy (--proxy 127.0.0.1:PORT mistyped, or dfdaemon down)
    from modelload.sidecar.sources import ProxySettings

    port = free_port()
    sources = SourceSettings(
        http=HttpSettings(connect_timeout=2.0, proxy=ProxySettings(http=("127.0.0.1", port), https=None)),
        retry=FAST.retry,
    )
    with pytest.raises(ModelloadError) as raised:
        load("http://127.0.0.1:9/m.safetensors", shm_dir / "m.seg", sources=sources)
    assert f"cannot connect to the proxy 127.0.0.1:{port} (for 127.0.0.1:9)" in str(raised.value)
