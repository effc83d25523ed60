"""The notebook table: HTML in a notebook, aligned text elsewhere, no pandas."""
import pytest

from iokernels.viz.htmltable import Table


def test_html_and_text():
    t = Table(("name", "value"), [("a <b>", "1.5%"), ("long words stay whole", "12,345")], caption="cap",
              note="a note")
    h = t._repr_html_()
    assert "a &lt;b&gt;" in h and "<b>cap</b>" in h and "a note" in h
    assert "white-space:nowrap'>1.5%" in h and "white-space:nowrap'>12,345" in h     # numbers never wrap
    assert "word-break:normal" in h                                                   # words never break
    lines = str(t).splitlines()
    assert lines[0] == "cap" and lines[1].split() == ["name", "value"] and lines[-1] == "a note"
    assert lines[2].index("1.5%") == lines[3].index("12,345")                       # aligned columns
    assert t.column("value") == ["1.5%", "12,345"] and "12,345" in t


def test_empty_table_shows_its_note_and_bad_rows_raise():
    t = Table(("x",), [], note="nothing recorded yet")
    assert "nothing recorded yet" in t._repr_html_() and str(t) == "nothing recorded yet"
    with pytest.raises(ValueError, match="rows"):
        Table(("a", "b"), [("1",)])
    with pytest.raises(ValueError, match="name"):
        Table(("a",), [("1",)]).column("b")
