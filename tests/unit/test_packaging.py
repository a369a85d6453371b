"""What pyproject.toml and tox.ini promise about installing redsrv: a build-system floor that can
read the SPDX license, the license file itself, extras that install beside users' GPU builds and
stop before framework releases the adapters' private reads were not tested against, pinned lint
tools, CI on TensorFlow's CPU build at the extra's own version range, and every package folder
in the wheel."""

from __future__ import annotations

import configparser
import re
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def requirement(requirements: list[str], name: str) -> Requirement:
    [found] = [r for r in map(Requirement, requirements) if r.name == name]
    return found


def release_tested(module: str, constant: str) -> Version:
    text = (ROOT / "adapters" / module).read_text()
    match = re.search(rf'^{constant} = "([0-9.]+)"', text, re.MULTILINE)
    assert match, f"{constant} not found in adapters/{module}"
    return Version(match.group(1))


def test_the_build_backend_can_read_the_spdx_license_and_ships_the_license_file() -> None:
    setuptools = requirement(PYPROJECT["build-system"]["requires"], "setuptools")
    assert not setuptools.specifier.contains("76.9") and setuptools.specifier.contains("77.0")  # PEP 639 support
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_the_tf_extra_is_tensorflow_bounded_by_the_release_the_private_reads_were_tested_on() -> None:
    names = [Requirement(r).name for r in EXTRAS["tf"]]
    assert "tensorflow-cpu" not in names  # a second distribution of tensorflow beside a user's GPU build
    tf = requirement(EXTRAS["tf"], "tensorflow")
    tested = release_tested("_tf_internals.py", "TESTED_TF")
    assert tf.specifier.contains(f"{tested}.0") and not tf.specifier.contains(f"{tested.major}.{tested.minor + 1}.0")


def test_the_jax_extra_stops_before_the_next_minor_release_after_the_tested_one() -> None:
    jax = requirement(EXTRAS["jax"], "jax")
    tested = release_tested("_jax_internals.py", "TESTED_JAX")
    assert jax.specifier.contains(f"{tested}.2") and not jax.specifier.contains(f"{tested.major}.{tested.minor + 1}.0")


def test_lint_tools_are_pinned() -> None:
    for name in ("ruff", "mypy"):
        [spec] = requirement(EXTRAS["dev"], name).specifier
        assert spec.operator == "==", f"{name} is not pinned: {spec}"


def test_ci_runs_tensorflows_cpu_build_at_the_tf_extras_range() -> None:
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    deps = Requirement(tox["testenv:tf"]["deps"].strip())
    assert deps.name == "tensorflow-cpu" and deps.specifier == requirement(EXTRAS["tf"], "tensorflow").specifier
    assert "tf" not in [e.strip() for e in tox["testenv:tf"]["extras"].split(",")]  # it would add `tensorflow` too


def test_every_tox_environment_runs_in_ci_or_says_it_is_by_hand() -> None:
    # The README names environments as what is tested (Keras 2: `tox -e tf-keras2`); one that CI
    # never runs must say so, or the claim is untested.
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    in_ci = {name.strip() for name in tox["tox"]["env_list"].split(",")}
    for section in tox.sections():
        name = section.removeprefix("testenv:")
        if section.startswith("testenv:") and name not in in_ci:
            assert "by hand" in tox[section]["description"], f"tox env {name!r} is neither in env_list nor by hand"
    readme = (ROOT / "README.md").read_text()
    assert "Keras 2 (`tox -e tf-keras2`)" in readme and "tf-keras2" in in_ci


def test_every_source_package_is_listed_so_the_wheel_installs_it() -> None:
    # setuptools installs the packages named in [tool.setuptools] packages and no others: a folder
    # with an __init__.py left out (a subpackage such as adapters/horovod/torch) is missing from the
    # wheel while an editable install still finds it.
    setuptools = PYPROJECT["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert found == listed, f"missing from packages: {sorted(found - listed)}; listed without a folder: {sorted(listed - found)}"
    assert {"redsrv.horovod.torch", "redsrv.adapters.horovod", "redsrv.adapters.horovod.keras"} <= listed


def test_release_wheels_hold_the_compiled_plane_on_both_linux_architectures() -> None:
    wheels = PYPROJECT["tool"]["cibuildwheel"]
    assert set(wheels["linux"]["archs"]) == {"x86_64", "aarch64"}
    # A release wheel without the plane would install silently slower: there the build must fail.
    assert wheels["environment"]["REDSRV_NATIVE_STRICT"] == "1"
    assert wheels["environment"]["REDSRV_TEST_REQUIRE_NATIVE"] == "1"
    assert "tests/unit/test_plane.py" in wheels["test-command"]
    assert "tests/unit/test_wire_fuzz.py" in wheels["test-command"]  # the C frame parser against the Python one


def test_without_a_compiler_the_install_warns_and_goes_on(tmp_path: Path) -> None:
    # As a user's `pip install .` builds it (an isolated build environment with the build-system's
    # own setuptools), on a machine whose compiler is missing.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("REDSRV_NATIVE_")}
    env["CC"] = str(tmp_path / "no-such-compiler")
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(wheels), str(ROOT)]
    done = subprocess.run(build, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (done.stdout + done.stderr).count("WARNING: redsrv's compiled data plane was not built") == 1
    [wheel] = wheels.glob("redsrv-*.whl")
    with zipfile.ZipFile(wheel) as contents:
        assert not [name for name in contents.namelist() if "_plane" in name]
        assert "redsrv/core/plane.py" in contents.namelist()
    env["REDSRV_NATIVE_STRICT"] = "1"  # CI's and the release wheels' setting: the same failure stops the build
    strict = subprocess.run(build, env=env, capture_output=True, text=True, timeout=300)
    assert strict.returncode != 0
