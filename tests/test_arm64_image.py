"""Fetching the arm64 guest's image (tests/arm64_image.py): a download that fails is
tried again, and one that keeps failing ends the build with what failed and why, not a
bare exit status. The downloads here are real processes; the mirror that cannot be
reached is a port nothing listens on."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from tests import arm64_image


def _flaky(tmp_path, fail_times: int) -> list[str]:
    """A download that fails its first ``fail_times`` runs (exit 3, a line on stderr), then prints ok."""
    count = tmp_path / "tries"
    code = (f"import sys; p = {str(count)!r}; n = int(open(p).read()) + 1 if __import__('os').path.exists(p) else 1\n"
            f"open(p, 'w').write(str(n))\n"
            f"if n <= {fail_times}: print('E: mirror answered 503 on try', n, file=sys.stderr); sys.exit(3)\n"
            f"print('ok')")
    return [sys.executable, "-c", code]


def test_a_download_that_fails_is_tried_again_and_its_output_returned(tmp_path):
    said = []
    assert arm64_image.fetch("the wheels", _flaky(tmp_path, 2), waits=(0, 0), log=said.append) == "ok\n"
    assert (tmp_path / "tries").read_text() == "3"
    assert said == ["arm64 image: the wheels failed (exit 3), try 2 of 3 in 0 s",
                    "arm64 image: the wheels failed (exit 3), try 3 of 3 in 0 s"]


def test_a_download_that_keeps_failing_names_itself_its_tries_and_its_last_words(tmp_path):
    with pytest.raises(arm64_image.BuildError) as err:
        arm64_image.fetch("the wheels", _flaky(tmp_path, 5), waits=(0, 0))
    assert (tmp_path / "tries").read_text() == "3"
    text = str(err.value)
    assert text.startswith("the wheels failed 3 times (last exit 3)")
    assert "is the network up?" in text and text.endswith("E: mirror answered 503 on try 3")


def test_an_unreachable_mirror_fails_the_arm64_lists_with_the_mirror_named(tmp_path):
    if shutil.which("apt-get") is None:
        if os.environ.get("CI"):
            pytest.fail("apt-get is missing (the arm64 image is fetched with it)")
        pytest.skip("no apt-get")
    etc = tmp_path / "etc"
    (etc / "sources.list.d").mkdir(parents=True)
    # apt's default only warns about a list it could not fetch; the update must fail here
    (etc / "sources.list").write_text("deb http://127.0.0.1:9/debian bookworm main\n")
    with pytest.raises(arm64_image.BuildError) as err:
        arm64_image._apt_setup(str(tmp_path / "apt"), str(etc), waits=())
    text = str(err.value)
    assert text.startswith("apt-get update (arm64 lists) failed 1 time (")
    assert "http://127.0.0.1:9/debian" in text and "is the network up?" in text
