"""`strata-mkmodel SHAPE OUT.gguf`: mkmodel.py's writer from the command line (a named shape,
its weight type, seed, head and NextN options), with a size estimate before it writes."""
from __future__ import annotations

from pathlib import Path

from strata.model.mkmodel import estimated_size, write_nextn_sidecar, write_random_gguf
from strata.model.quant_mix import WEIGHT_TYPES
from strata.model.shapes import SHAPES

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _cli():
    import click

    @click.command(name="strata-mkmodel", context_settings={"help_option_names": ["-h", "--help"]})
    @click.version_option(package_name="strata", prog_name="strata-mkmodel")
    @click.argument("shape_name", metavar="SHAPE")
    @click.argument("out", metavar="OUT.gguf", type=click.Path(dir_okay=False, path_type=Path))
    @click.option("--weight-type", default="BF16", show_default=True,
                  type=click.Choice(WEIGHT_TYPES, case_sensitive=False),
                  help="Type of the matrices (norms are always F32). K-quants, IQ types and "
                       "NVFP4 are random valid blocks, whose block size (256 for most) must "
                       "divide every row; Q3_K_M, Q4_K_M and Q5_K_M mix types per tensor as "
                       "llama.cpp's llama-quantize does.")
    @click.option("--seed", default=0, show_default=True, type=int, help="Random seed.")
    @click.option("--untied", is_flag=True, help="Write a separate output.weight head.")
    @click.option("--std", default=0.02, show_default=True, type=float,
                  help="Standard deviation of the matrices' values.")
    @click.option("--force", is_flag=True, help="Overwrite OUT.gguf if it exists.")
    @click.option("--fast", is_flag=True,
                  help="Every matrix repeats one pool of random values or blocks of its "
                       "type: seconds instead of minutes for large shapes (for performance "
                       "runs).")
    @click.option("--nextn", is_flag=True,
                  help="Add a random NextN (MTP) head in llama.cpp's layout: block_count + 1, "
                       "nextn_predict_layers 1.")
    @click.option("--nextn-sidecar", type=click.Path(dir_okay=False, path_type=Path),
                  default=None, help="Also write the same random NextN head as a sidecar GGUF "
                                     "for this model (strata-launch --mtp-head PATH).")
    def main(shape_name, out, weight_type, seed, untied, std, force, fast, nextn, nextn_sidecar):
        """Write a GGUF with random weights of a named SHAPE (its family's architecture).

        Shapes: """
        if shape_name not in SHAPES:
            raise click.BadParameter(
                f"unknown shape {shape_name!r}; known shapes: {', '.join(SHAPES)}",
                param_hint="SHAPE")
        shape = SHAPES[shape_name]
        for path in (out, nextn_sidecar):
            if path is not None and path.exists() and not force:
                raise click.UsageError(f"{path} exists; pass --force to overwrite it")
        tied = not untied
        try:
            size = estimated_size(shape, weight_type, tied, nextn)
        except ValueError as e:
            raise click.UsageError(str(e)) from e
        params = shape.n_params + (0 if tied else shape.vocab * shape.d_model)
        click.echo(f"{shape_name}: {params / 1e9:.2f}B parameters, {weight_type.upper()}, "
                   f"{'tied' if tied else 'untied'} head, about {_fmt_bytes(size)} -> {out}",
                   err=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_random_gguf(out, shape, seed=seed, weight_type=weight_type, tied=tied,
                              std=std, progress=True, fast=fast, nextn=nextn)
            if nextn_sidecar is not None:
                nextn_sidecar.parent.mkdir(parents=True, exist_ok=True)
                write_nextn_sidecar(nextn_sidecar, out, shape, seed=seed,
                                    weight_type=weight_type, std=std)
        except ValueError as e:
            raise click.UsageError(str(e)) from e
        click.echo(str(out))
        if nextn_sidecar is not None:
            click.echo(str(nextn_sidecar))

    main.help = (main.help or "").replace("Shapes: ", "Shapes: " + ", ".join(
        f"{k} ({v.n_layers}x{v.d_model})" for k, v in SHAPES.items()) + ".")
    return main


main = _cli()

if __name__ == "__main__":
    main()
