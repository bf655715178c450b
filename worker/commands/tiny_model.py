"""`tandem make-tiny-model DIR`: write a tiny random-weight model folder."""

from __future__ import annotations

import click

from tandem.worker.model.config import FAMILIES as TINY_FAMILIES


@click.command("make-tiny-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--family", type=click.Choice(list(TINY_FAMILIES)), default="llama",
              show_default=True, help="Model family (architecture) to write.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--layers", type=int, default=None, help="Number of decoder layers (default 2).")
@click.option("--hidden-size", type=int, default=None, help="Hidden size (default 64).")
def command(directory: str, family: str, seed: int, layers: int | None, hidden_size: int | None) -> None:
    """Write a tiny random-weight model folder (config.json, safetensors, tokenizer, chat template)."""
    from tandem.worker.model.tiny import write_tiny_model

    overrides: dict[str, int] = {}
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    if hidden_size is not None:
        overrides["hidden_size"] = hidden_size
        overrides["intermediate_size"] = 2 * hidden_size
    try:
        path = write_tiny_model(directory, family=family, seed=seed, **overrides)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"wrote a tiny {family} model to {path}")
