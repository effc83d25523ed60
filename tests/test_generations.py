"""The generations table and hardware matrix: complete, framed, and honest about status."""
from iokernels import generations as g


def test_every_generation_says_what_changed_and_where_its_numbers_come_from():
    names = [x.name for x in g.GENERATIONS]
    assert names == ["FlashAttention", "FlashAttention-2", "FlashAttention-3", "FlashAttention-4"]
    for gen in g.GENERATIONS:
        assert gen.changed and gen.reported and gen.paper
        for claim, where in gen.reported:
            assert claim and where, gen.name            # every figure names its setting (GPU, model, test)


def test_framing_and_status_are_kept():
    fa3 = next(x for x in g.GENERATIONS if x.name == "FlashAttention-3")
    assert "beta" in fa3.status and "FP8 forward" in fa3.status
    text = g.generations_table()
    assert "up to 740 TFLOP/s" in text and "up to 1,613 TFLOP/s" in text and "B200" in text
    assert all("up to" in claim for claim, _ in next(x for x in g.GENERATIONS if x.name == "FlashAttention-4").reported)


def test_hardware_matrix_covers_every_architecture():
    for gen, row in g.HARDWARE.items():
        assert set(row) == set(g.ARCHITECTURES), gen
    assert g.HARDWARE["FlashAttention-3"]["Hopper"] and not g.HARDWARE["FlashAttention-3"]["Ampere"]
    m = g.hardware_matrix()
    assert all(a in m for a in g.ARCHITECTURES) and "community fork" in m
    assert len(g.CAVEATS) >= 4


def test_fa2_builds_for_blackwell_but_is_not_listed():
    assert g.HARDWARE["FlashAttention-2"]["Blackwell"] == "builds; not listed"
    assert any("12.8" in n and "Blackwell" in n for n in g.HARDWARE_NOTES)
    fa2 = next(x for x in g.GENERATIONS if x.name == "FlashAttention-2")
    assert any("350" in claim and "blog post" in claim for claim, _ in fa2.reported)
