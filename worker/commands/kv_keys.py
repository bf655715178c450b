"""`tandem kv-keys DIR`: write a KV transfer keypair for `tandem worker --kv-keys DIR` (secure KV transfer)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("kv-keys")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace keys already in FOLDER.")
def command(folder: Path, force: bool) -> None:
    """Write a new CURVE keypair (files `public` and `secret`) into FOLDER."""
    from tandem.worker.kv.keys import PUBLIC_FILE, SECRET_FILE, KVKeys

    if not force and ((folder / PUBLIC_FILE).exists() or (folder / SECRET_FILE).exists()):
        raise click.ClickException(f"{folder} already holds KV keys (--force replaces them; every worker of the "
                                   "model must then get the new ones)")
    keys = KVKeys.generate()
    keys.save(folder)
    click.echo(f"wrote {folder / PUBLIC_FILE} and {folder / SECRET_FILE} (mode 0600); "
               f"pass --kv-keys {folder} to every worker of the model")
