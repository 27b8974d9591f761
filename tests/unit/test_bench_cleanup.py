"""The end-to-end bench leaves no saved hot set of its transient domains on the host (bench/e2e_run.py)."""

from __future__ import annotations

from pathlib import Path

from bench.e2e_plan import Vm
from bench.e2e_run import forget_hotsets

U1, U2, OTHER = ("0b47ad53-0035-4ba8-96d9-f08cd6d41c63", "119dcfd9-24dd-426a-9378-c24834653a34",
                 "4a85f6fb-9a02-44cd-9229-02ed166b867d")


def test_the_hot_sets_the_arms_agents_saved_are_removed_and_no_other(tmp_path: Path) -> None:
    hotsets = tmp_path / "hotsets"
    hotsets.mkdir()
    for name in (U1, U2, OTHER):
        (hotsets / f"{name}.xml").write_text("<hotset/>")
    config = tmp_path / "vmcache.yaml"
    config.write_text(f"hotset_dir: {hotsets}\n")
    vms = [Vm("a", Path("/img/a"), "cg", Path("c1"), uuid=U1), Vm("b", Path("/img/b"), "cg", Path("c2"), uuid=U2),
           Vm("c", Path("/img/c"), "cg", Path("c3"))]  # never started: no uuid
    forget_hotsets(vms, str(config))
    assert sorted(p.name for p in hotsets.iterdir()) == [f"{OTHER}.xml"]
    forget_hotsets(vms, str(config))  # gone already: nothing to do


def test_a_config_it_cannot_read_leaves_them_and_says_so(tmp_path: Path, capsys) -> None:
    config = tmp_path / "vmcache.yaml"
    config.write_text("hotset_dir: [not, a, path]\n")
    forget_hotsets([Vm("a", Path("/img/a"), "cg", Path("c1"), uuid=U1)], str(config))
    assert "the agents' saved hot sets stay" in capsys.readouterr().out
