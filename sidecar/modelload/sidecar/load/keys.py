"""A load's decryption key: checked when the sidecar starts, read when a load needs it, matched to the model.

The settings hold only the paths of the key or password file (a mounted Secret), never the key. The files
are checked at the sidecar's start (:func:`check_key_files`), so a Secret that is not mounted, or holds a
passphrase where a raw key belongs, stops the sidecar with exit status 2 and the flag to fix, instead of
failing the load later as an internal error. Each load reads the key again (:func:`read_key`: a Secret
unmounted since is a ConfigError too), and it must fit the model (:func:`check_key`): a key for a model
that is not encrypted, or none for one that is, is refused before anything is planned.
"""

from __future__ import annotations

from pathlib import Path

from modelload.loader.errors import ConfigError, MissingKeyError, NotEncryptedError
from modelload.loader.formats import ModelIndex
from modelload.loader.formats.tensorizer import DecryptionKey
from modelload.sidecar.load.settings import LoadSettings

__all__ = ["KEY_SETTING", "PASSWORD_SETTING", "check_key", "check_key_files", "read_key"]

KEY_SETTING = "--key-file/MODELLOAD_KEY_FILE"
PASSWORD_SETTING = "--password-file/MODELLOAD_PASSWORD_FILE"  # noqa: S105 - a setting's name


def check_key_files(settings: LoadSettings) -> None:
    """ConfigError, naming the flag and variable, when the key or password file cannot be read or is not a
    key (see the module)."""
    if settings.key_file is not None:
        try:
            DecryptionKey.from_file(settings.key_file)
        except OSError as exc:
            raise ConfigError(_unreadable("key", settings.key_file, exc), setting=KEY_SETTING) from None
        except ConfigError as exc:
            raise ConfigError(str(exc), setting=KEY_SETTING) from None
    if settings.password_file is not None:
        try:
            empty = not settings.password_file.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                _unreadable("password", settings.password_file, exc), setting=PASSWORD_SETTING
            ) from None
        if empty:
            raise ConfigError(
                f"the password file {settings.password_file} is empty", setting=PASSWORD_SETTING
            )


def read_key(settings: LoadSettings) -> DecryptionKey | None:
    """The load's key from its key or password file; None when it has neither."""
    try:
        if settings.key_file is not None:
            return DecryptionKey.from_file(settings.key_file)
        if settings.password_file is not None:
            return DecryptionKey.from_password_file(settings.password_file)
    except OSError as exc:  # checked at start; gone since (a Secret unmounted)
        path = settings.key_file or settings.password_file
        flag = "--key-file" if settings.key_file is not None else "--password-file"
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", setting=flag) from None
    return None


def check_key(index: ModelIndex, uri: str, key: DecryptionKey | None) -> None:
    """Refuse a key for a model that is not encrypted, and no key for one that is."""
    if key is not None and not index.encrypted:
        raise NotEncryptedError(f"{uri} is not encrypted, but a decryption key was given; drop the key")
    if key is None and index.encrypted:
        raise MissingKeyError(
            f"{uri} is encrypted and no key was given: pass --key-file or --password-file "
            "(a ModelLoad's decryptionKeySecretRef)"
        )


def _unreadable(what: str, path: Path, exc: OSError) -> str:
    reason = "it does not exist" if isinstance(exc, FileNotFoundError) else exc.strerror or type(exc).__name__
    return (
        f"cannot read the {what} file {path}: {reason}; mount the Secret that holds it there (a ModelLoad's"
        f" {'decryptionKeySecretRef' if what == 'key' else 'passwordSecretRef'}) or fix the path"
    )
