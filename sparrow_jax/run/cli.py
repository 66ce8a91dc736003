"""Entry-point helper: parse ``--config`` once into a :class:`RunSpec`; a bad config, an
unknown override or a missing config file prints one line naming the field (or file) and exits
with status 2 (no traceback)."""
from __future__ import annotations

import sys
from typing import Any, Callable

from absl import app, flags

from sparrow_jax.run.specs import ConfigError, RunSpec, parse_spec

EXIT_BAD_CONFIG = 2


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_CONFIG)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _fail(str(e))
    except OSError as e:  # an override makes ml_collections load the config file while parsing
        _fail(_load_error(e, "config", _flag_value(argv, "config")))
    except (AttributeError, KeyError) as e:  # ml_collections: an override of a field the config lacks
        # ml_collections wraps a KeyError in the AttributeError and may append "Did you mean ..."
        # after the field's name: unwrap, keep the first line
        arg = e
        while isinstance(arg, BaseException) and arg.args:
            arg = arg.args[0]
        missing = str(arg).splitlines()[0].strip("\"'")
        bad = [a.split("=", 1)[0] for a in argv[1:]
               if a.startswith("--config.") and missing in a.split("=", 1)[0].split(".")]
        _fail(f"{bad[0] if bad else missing}: unknown config field ('{missing}' is not in the config)")


def _flag_value(argv: list[str], name: str) -> str | None:
    """The value given to ``--name`` (``--name=v`` or ``--name v``) on the command line."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _load_error(e: OSError, name: str, path: str | None) -> str:
    # the loader's message ends with the cause, e.g. "[Errno 2] No such file or directory: ..."
    cause = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
    return f"--{name}={path}: cannot load the config file ({cause})"


def _config_value(config_flag: Any) -> Any:
    """The loaded config; a missing or unloadable ``--config`` file is a :class:`ConfigError`."""
    name = getattr(config_flag, "name", "config")
    try:
        value = config_flag.value
        if value is not None:
            value.keys()  # ml_collections reports a file it could not load on first access, not at parse time
    except OSError as e:
        raise ConfigError(_load_error(e, name, flags.FLAGS[name].config_filename)) from None
    if value is None:
        raise ConfigError(f"--{name} is required: a config file, e.g. --{name} configs/quickstart.py")
    return value


def config_main(config_flag: Any, main: Callable[[RunSpec], Any]) -> None:
    """``app.run`` with the run config parsed into a spec and handed to ``main(spec)``."""
    def run(argv: list[str]) -> None:
        del argv
        from absl import logging
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
        try:
            spec = parse_spec(_config_value(config_flag))
        except ConfigError as e:
            _fail(str(e))
        try:
            main(spec)
        except ConfigError as e:
            _fail(str(e))

    app.run(run, flags_parser=_parse_flags)
