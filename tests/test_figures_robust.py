"""repro.figures under faults: figures written atomically, corrupt jobs skipped, diffs refusing mismatched traces."""

import matplotlib.pyplot as plt
import pytest

from repro.figures.report import _save

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_save_writes_a_png_atomically_and_a_failed_save_leaves_nothing(tmp_path, monkeypatch):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    path = _save(fig, tmp_path / "sub" / "fig.png")
    assert path.read_bytes().startswith(PNG_MAGIC)  # PNG although the temporary name ends in a random suffix
    before = path.read_bytes()

    fig, ax = plt.subplots()

    def killed_mid_write(target, **kwargs):
        with open(target, "wb") as f:
            f.write(PNG_MAGIC[:4])  # a partial file, then the writer dies
        raise KeyboardInterrupt

    monkeypatch.setattr(fig, "savefig", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        _save(fig, path)
    assert path.read_bytes() == before  # the old complete figure stays
    assert [p.name for p in path.parent.iterdir()] == ["fig.png"]  # no temporary file left behind
    assert not plt.get_fignums()  # closed even on failure
