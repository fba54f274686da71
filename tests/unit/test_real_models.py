"""specdec.tools.real_models.prepare: one run at a time builds the real pair's folders."""

from __future__ import annotations

import fcntl
import threading
import time

from specdec.tools import real_models
from specdec.tools.real_models import TARGET


def test_a_second_run_waits_for_the_first_and_builds_nothing(tmp_path, monkeypatch):
    """Two `make run`s at once wrote the same GGUF: one renamed a file the other had truncated
    under it, its SHA-256 (of the bytes read) matching all the same. The second now waits for the
    first's lock and finds the folder it built."""
    built = []
    monkeypatch.setattr(real_models, "_build", lambda model, cache_dir, folder: built.append(folder))
    first = open(tmp_path / ".prepare.lock", "w")  # noqa: SIM115 - held across the second's start
    fcntl.flock(first, fcntl.LOCK_EX)  # the first run, building
    result = {}
    second = threading.Thread(target=lambda: result.update(folder=real_models.prepare(TARGET, tmp_path)))
    second.start()
    time.sleep(0.3)
    assert second.is_alive(), "the second run did not wait for the first"
    (tmp_path / TARGET.name).mkdir()
    (tmp_path / TARGET.name / real_models._READY_MARKER).write_text("ready\n")
    first.close()  # the first run is done
    second.join(10)
    assert result["folder"] == tmp_path / TARGET.name and built == []
