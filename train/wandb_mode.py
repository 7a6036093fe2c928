"""W&B mode of a ``train.logger=wandb`` run: online with a login, offline without, never a prompt.

The decision (:func:`decide_wandb_mode`), in this order:

1. ``$WANDB_MODE`` set by the user (``online``, ``offline``, ``disabled``, ...): obeyed.
2. a ``mode`` written in wandb's settings files (``wandb offline`` / ``wandb disabled`` write it into
   ``./wandb/settings``; the global file is ``$WANDB_CONFIG_DIR/settings`` or
   ``~/.config/wandb/settings``): obeyed.
3. credentials wandb itself would use for ``$WANDB_BASE_URL`` (default https://api.wandb.ai):
   ``WANDB_API_KEY`` / ``WANDB_IDENTITY_TOKEN_FILE``, the netrc entry ``wandb login`` writes
   (``$NETRC`` or ``~/.netrc``), or an ``api_key`` in wandb's settings files -> ``online``.
4. none of these -> ``offline`` (the run is written under ``<run_dir>/wandb/``; ``wandb sync``
   uploads it later).

``train.logger`` decides first whether W&B runs at all (``csv`` / ``none``: never).  The chosen
mode is passed to ``wandb.init(mode=...)`` explicitly, so wandb never reaches its own login
step (which raises "No API key configured" without a terminal and opens an interactive menu in
one).  The look-up reads wandb's own helpers and settings files without starting wandb's
session, and sends nothing over the network; the decision is printed as one line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_BASE_URL = "https://api.wandb.ai"
OFFLINE_MODES = ("offline", "dryrun", "disabled")


@dataclass(frozen=True)
class WandbMode:
    """The W&B mode of a run and why it was chosen.

    Attributes:
        mode: what ``wandb.init(mode=...)`` gets: ``online``, ``offline``, ``disabled`` (or another
            value the user set in ``WANDB_MODE``, passed through).
        reason: where it came from (``"WANDB_MODE=offline"``, ``"credentials from /home/u/.netrc"``,
            ``"no W&B login found (...)"``).
    """

    mode: str
    reason: str

    @property
    def offline(self) -> bool:
        """True for a mode that uploads nothing (``offline``, ``dryrun``, ``disabled``)."""
        return self.mode in OFFLINE_MODES

    def line(self, run_dir: str | os.PathLike | None = None) -> str:
        """The one line a run prints about its W&B mode."""
        text = f"draftheads: W&B {self.mode} ({self.reason})"
        if self.mode in ("offline", "dryrun"):
            where = f"{Path(run_dir) / 'wandb'}/offline-run-*" if run_dir is not None else "<run dir>/wandb/offline-run-*"
            text += f"; upload it later with `wandb sync {where}`, or log in (`wandb login`) to go online"
        elif self.mode == "online":
            text += "; set WANDB_MODE=offline to keep it local"
        return text


def _settings_files():
    """A fresh ``wandb.Settings`` with only wandb's settings files applied (workspace ``./wandb/settings``
    and the global one), or None when this wandb has no such API.  wandb's session is not started."""
    try:
        from wandb.sdk.wandb_settings import Settings
    except ImportError:
        return None
    try:
        s = Settings(silent=True)
        config_dir = os.environ.get("WANDB_CONFIG_DIR")
        s.settings_system = str(Path(config_dir).expanduser() / "settings") if config_dir else \
            str(Path("~", ".config", "wandb", "settings").expanduser())
        s.update_from_system_settings()
        return s
    except Exception:  # a malformed settings file is wandb's to report when it starts
        return None


def find_credentials(base_url: str | None = None) -> str | None:
    """Where wandb would find credentials for ``base_url`` (default ``$WANDB_BASE_URL`` or
    https://api.wandb.ai): the environment variable's name, the netrc file's path, or
    ``"wandb settings"``; None when there are none.

    Uses wandb's own look-up (``wandb.sdk.lib.wbauth``: environment, then netrc) and its settings
    files, without contacting the server.  A credential wandb rejects as malformed (e.g. a netrc
    password that is not an API key, or both ``WANDB_API_KEY`` and ``WANDB_IDENTITY_TOKEN_FILE``)
    counts as none.
    """
    url = base_url or os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
    try:
        from wandb.sdk.lib.wbauth import authenticate, wbnetrc
        from wandb.sdk.lib.wbauth.host_url import HostUrl
    except ImportError:  # another wandb layout: the environment is all we can read safely
        return "WANDB_API_KEY" if os.environ.get("WANDB_API_KEY") else None
    try:
        host = HostUrl(url)
        found = authenticate._try_env_auth(host=host) or wbnetrc.read_netrc_auth_with_source(host=host)
    except Exception:  # an unusable credential is not a login
        return None
    if found is not None:
        return str(found.source)
    settings = _settings_files()
    if settings is not None and settings.api_key and host.is_same_url(settings.base_url):
        return "wandb settings"
    return None


def check_mode(mode: str) -> None:
    """Refuse a ``WANDB_MODE`` wandb does not know, by wandb's own settings model, before the run starts (wandb
    raised a pydantic traceback at ``wandb.init``, after the run directory was made).

    Raises:
        core.config.UserInputError: naming the value and wandb's own list of modes.
    """
    from wandb.sdk.wandb_settings import Settings

    try:
        Settings(mode=mode)
    except Exception as exc:  # pydantic's ValidationError, whose text lists the modes wandb accepts
        from core.config import UserInputError

        allowed = next((line.strip() for line in str(exc).splitlines() if "Input should be" in line), str(exc))
        raise UserInputError(f"WANDB_MODE={mode!r} is not a W&B mode ({allowed.split(' [')[0]}); unset it to let "
                             "draftheads choose (offline without a login)") from None


def decide_wandb_mode(base_url: str | None = None) -> WandbMode:
    """The run's W&B mode (module docstring: ``WANDB_MODE``, wandb's settings, credentials, else offline).

    Never prompts and never touches the network.

    Raises:
        core.config.UserInputError: ``WANDB_MODE=online`` with no login wandb could use (wandb would
            ask for one on a terminal, and fail with a traceback without one), or a ``WANDB_MODE`` wandb
            does not know (:func:`check_mode`).
    """
    mode = os.environ.get("WANDB_MODE")
    if mode == "online" and find_credentials(base_url) is None:
        from core.config import UserInputError

        raise UserInputError("WANDB_MODE=online but no W&B login was found (no WANDB_API_KEY, no netrc entry, no key "
                             "in wandb's settings): run `wandb login` first, or unset WANDB_MODE to log offline "
                             "(`wandb sync` uploads the run later)")
    if mode:
        check_mode(mode)
        return WandbMode(mode, f"WANDB_MODE={mode}")
    settings = _settings_files()
    if settings is not None and "mode" in getattr(settings, "model_fields_set", set()) and settings.mode != "online":
        return WandbMode(str(settings.mode), f"mode {settings.mode} in wandb's settings")
    source = find_credentials(base_url)
    if source is not None:
        return WandbMode("online", f"credentials from {source}")
    from urllib.parse import urlsplit

    host = urlsplit(base_url or os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).netloc
    return WandbMode("offline", f"no W&B login found: no WANDB_API_KEY, no {host} entry in "
                                f"{os.environ.get('NETRC') or '~/.netrc'}, no key in wandb's settings")
