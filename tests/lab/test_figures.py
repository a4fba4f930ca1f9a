"""One colour and one display name per loss in every figure: the palette helper (vespo.plot) covers
every loss the shipped sweep files name, the new ones included, and a loss's colour does not depend
on which other losses share the figure."""

from pathlib import Path

from vespo.lab.figures import value_colors
from vespo.lab.grid import load_sweep
from vespo.plot import LOSSES, color_of, display_name

LAB = Path(__file__).resolve().parents[2] / "configs" / "lab"


def _shipped_values(axis: str) -> set[str]:
    out = set()
    for f in LAB.glob("*.yaml"):
        if f.name != "claims.yaml":
            out |= {v for a in load_sweep(f).axes if a.label == axis for v in a.values}
    return out


def test_every_shipped_loss_has_its_own_colour_and_name():
    losses = _shipped_values("loss")
    assert {"vespo", "grpo", "gspo", "sapo", "dppo_tv", "dppo_kl", "m2po", "vespo_ess_lr", "grpo_ess_lr"} <= losses
    assert losses <= set(LOSSES), sorted(losses - set(LOSSES))
    colours = [color_of(x) for x in LOSSES]
    assert len(set(colours)) == len(colours)  # no two losses share a colour
    for method in _shipped_values("method"):  # a loss with a fix: its loss's colour, and a name saying the fix
        base = max((k for k in LOSSES if method == k or method.startswith(k + "_")), key=len, default=method)
        assert color_of(method) == color_of(base) and display_name(method).startswith(display_name(base))


def test_display_names():
    assert [display_name(x) for x in ("vespo", "dppo_tv", "grpo_tis", "vespo_r2", "grpo_geo", "vespo_fp32", "m2po")] == [
        "VESPO", "DPPO-TV", "GRPO + TIS", "VESPO + R2", "GRPO + geo mask", "VESPO + fp32 engine", "M2PO"]
    assert display_name("vespo_ess_lr") == "VESPO + ESS step"  # the whole name before its parts
    assert display_name("my_loss") == "my_loss"


def test_a_losss_colour_does_not_depend_on_the_other_losses_in_the_figure():
    assert value_colors("loss", ["grpo", "vespo"])["vespo"] == value_colors("loss", ["vespo"])["vespo"] == color_of("vespo")
    assert color_of("unknown_loss") == color_of("unknown_loss") and color_of("unknown_loss") not in {
        c for _, c in LOSSES.values()}
    ns = value_colors("N", ["1", "8", "64"])  # not a loss axis: evenly along a colormap, in order
    assert len(set(ns.values())) == 3
