"""hpsray and hpsray.pipelines export their names lazily through one helper (hpsray/lazy.py):
importing the package imports none of their modules (no torch), the first access does."""

import subprocess
import sys

import pytest

import hpsray
import hpsray.pipelines


def test_importing_the_packages_imports_no_torch():
    code = (
        "import sys, hpsray, hpsray.pipelines; before = 'torch' in sys.modules; "
        "hpsray.ReferenceTrainer; print(before, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


@pytest.mark.parametrize("package", [hpsray, hpsray.pipelines])
def test_every_exported_name_resolves_and_an_unknown_one_is_an_attribute_error(package):
    for name in package.__all__:
        assert getattr(package, name) is not None and name in dir(package)
    with pytest.raises(AttributeError, match=rf"module '{package.__name__}' has no attribute 'nope'"):
        package.nope  # noqa: B018
