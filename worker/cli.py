"""The `tandem` command line.

Each subcommand lives in its own module and exposes a click command named `command`; this
file only maps names to modules and imports them lazily, so `tandem operator` never imports
torch and `tandem serve` never imports kopf.
"""

from __future__ import annotations

import importlib
import sys

import click

# name -> (module that defines `command`, one-line help, where it is built)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("tandem.worker.commands.serve", "Run router + prefill + decode workers on this machine.", "issue 5"),
    "worker": ("tandem.worker.commands.worker", "Run one worker process (prefill, decode or both).", "issue 5"),
    "router": ("tandem.worker.commands.router", "Run the OpenAI-compatible router.", "issue 5"),
    "bench": ("tandem.worker.commands.bench", "Load-test an OpenAI endpoint (TTFT, ITL, goodput).", "issue 5"),
    "plan": ("tandem.worker.commands.plan", "Size the prefill and decode pools for a load and its SLOs.", "issue 19"),
    "profile": ("tandem.worker.commands.profile", "Measure one worker into a capacity profile (for plan).", "issue 19"),
    "doctor": ("tandem.worker.commands.doctor", "Say which KV transports, GPUs and links work here.", "issue 5"),
    "operator": ("tandem.operator.main", "Run the Kubernetes operator (kopf).", "issue 3"),
    "kv-keys": ("tandem.worker.commands.kv_keys", "Write a keypair for secure KV transfer (--kv-keys).", "issue 3"),
    "make-tiny-model": ("tandem.worker.commands.tiny_model", "Write a tiny random-weight model folder.", "issue 4"),
    "fetch-model": ("tandem.worker.commands.fetch_model",
                    "Download and unpack a model folder archive (http/https, optional sha256).", "issue 3"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in SUBCOMMANDS:
            return None
        module_name, help_text, where = SUBCOMMANDS[cmd_name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                return _not_yet(cmd_name, help_text, where)
            return _missing_dependency(cmd_name, help_text, exc)
        command = module.command
        assert isinstance(command, click.Command)
        return command


def _not_yet(name: str, help_text: str, where: str) -> click.Command:
    @click.command(name, help=f"{help_text} [not built yet: {where}]",
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def stub() -> None:
        click.echo(f"tandem {name}: not available in this version yet ({where} has not landed).", err=True)
        sys.exit(2)

    return stub


def _missing_dependency(name: str, help_text: str, exc: ModuleNotFoundError) -> click.Command:
    extra = "operator" if name == "operator" else "worker"

    @click.command(name, help=f"{help_text} [needs: pip install 'tandem-serving[{extra}]']",
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def stub() -> None:
        click.echo(f"tandem {name}: missing Python package {exc.name!r}; "
                   f"install it with: pip install 'tandem-serving[{extra}]'", err=True)
        sys.exit(2)

    return stub


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tandem-serving")
def main() -> None:
    """Tandem: prefill/decode disaggregated LLM serving."""


if __name__ == "__main__":
    main()
