"""The model directory: a directory model's small files (config, tokenizer), beside the segment.

Engines take a model *path*: transformers and vLLM read ``config.json`` and the tokenizer from it. The writer
of a segment (the sidecar, or ``modelload stage``) copies every small file of the source directory there
(never a weight file: the weights are in the segment) before it publishes the segment, whose metadata names
the directory, so an app that attaches finds both.

The directory is replaced whole: the files land in a hidden directory beside it, which is renamed into
place, so a reader never finds a mix of two loads' files. Files are world-readable (0644): they are the
model's configuration, and the app's container may run as another user.

Only a directory a writer made is replaced (or removed after a failed load): one that holds the hidden
:data:`MARKER` file, or an empty one. Any other folder is refused, whatever the path was meant to be: the
model's own source folder (``modelload stage /data/model /data/model.seg`` puts the default model directory,
``model/`` beside the segment, there), a home directory given as ``--model-dir``. Replacing it would delete
the user's files.

A segment on hugetlbfs (huge pages) cannot have its model directory beside it: hugetlbfs files are written
through mappings only, in whole pages, so ``config.json`` could not be written there (and would not read back
as JSON). The model directory then goes on another volume (``--model-dir``), and one beside it is refused.
"""

from __future__ import annotations

import errno
import secrets
import shutil
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from modelload.loader.errors import ConfigError, SegmentError
from modelload.loader.segment.pages import volume_of
from modelload.loader.segment.volume import full_volume

__all__ = ["MARKER", "remove_model_dir", "write_model_dir"]

MARKER = ".modelload-model-dir"
"""The file that marks a model directory a writer made, and may therefore replace whole."""


def write_model_dir(
    target: Path, names: Collection[str], fetch: Callable[[str], bytes], *, workers: int = 8
) -> Path:
    """Fill ``target`` with ``fetch(name)`` for every name (replacing what is there); return its absolute
    path. Names are plain file names, as :func:`~modelload.loader.formats.select_model_files` checks them.
    """
    target = target.absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(
            f"the model directory {target} exists and is not a directory: remove it or choose another"
        )
    _refuse_foreign(target)
    token = f"{target.name}.{secrets.token_hex(4)}"
    staging = target.with_name(f".{token}.new")
    retired = target.with_name(f".{token}.old")

    def put(name: str) -> None:
        path = staging / name
        with path.open("wb") as file:
            file.write(fetch(name))
        path.chmod(0o644)

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if volume_of(target.parent).mapping_only:
            raise ConfigError(
                f"the model directory {target} is on hugetlbfs, which holds only mapped, page-sized files: "
                "put the model directory on another volume (--model-dir / MODELLOAD_MODEL_DIR; the operator "
                "does this for spec.memory.hugePages)"
            )
        staging.mkdir(mode=0o755)
        staging.chmod(0o755)
        with ThreadPoolExecutor(
            max_workers=max(1, min(workers, len(names))), thread_name_prefix="files"
        ) as pool:
            list(pool.map(put, sorted(names)))
        (staging / MARKER).write_bytes(b"written by modelload: replaced whole by the next load\n")
        if target.exists():
            target.rename(retired)
        staging.rename(target)
    except OSError as exc:
        raise _translate(exc, target) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(retired, ignore_errors=True)
    return target


def _refuse_foreign(target: Path) -> None:
    """ConfigError unless ``target`` is missing, empty, or a model directory a writer made."""
    try:
        names = sorted(entry.name for entry in target.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise _translate(exc, target) from exc
    if not names or MARKER in names:
        return
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    raise ConfigError(
        f"the model directory {target} already holds files modelload did not write ({shown}), and a model "
        "directory is replaced whole on every load, which would delete them: name a new or empty folder "
        "(--model-dir / MODELLOAD_MODEL_DIR; by default model/ beside the segment, so stage a model folder "
        "into a segment elsewhere than beside it). If an earlier modelload wrote it, remove it first"
    )


def _translate(exc: OSError, target: Path) -> SegmentError:
    full = full_volume(
        exc,
        f"no room for the model's small files in {target.parent}",
        advice="size the volume for the weights and the small files",
    )
    if full is not None:
        return full
    if exc.errno == errno.EROFS:
        return SegmentError(f"cannot write the model directory {target}: the file system is read-only")
    return SegmentError(f"cannot write the model directory {target}: {exc.strerror or exc}")


def remove_model_dir(target: Path) -> None:
    """Remove a model directory a failed load wrote (its small files hold memory on a memory-backed
    volume). A link at ``target`` is removed, never followed; a folder without :data:`MARKER` is left."""
    if target.is_symlink():
        target.unlink()
    elif (target / MARKER).is_file():
        shutil.rmtree(target, ignore_errors=True)
