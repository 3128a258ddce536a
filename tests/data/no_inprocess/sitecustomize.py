"""An NVRx without the in-process Wrapper, for the tests: with this folder first on PYTHONPATH, Python
loads this module at start-up and ``nvidia_resiliency_ext.inprocess`` cannot be imported in any process of
the job (its CLI, supervisor, launchers, zygotes and ranks).

``EKSFT_TEST_NO_INPROCESS=absent`` (the default): the module is not there (``find_spec`` fails too), as in
a release that dropped it; ``broken``: it is found but fails to import, as where its dependencies are
missing (the ranks find out, not the supervisor).
"""

import importlib.abc
import importlib.machinery
import os
import sys

HIDDEN = "nvidia_resiliency_ext.inprocess"


class _Broken(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(f"{module.__name__} is broken here (the test's sitecustomize)",
                          name=module.__name__)


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != HIDDEN and not name.startswith(HIDDEN + "."):
            return None
        if os.environ.get("EKSFT_TEST_NO_INPROCESS", "absent") == "broken":
            return importlib.machinery.ModuleSpec(name, _Broken(), is_package=True)
        raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test's sitecustomize)", name=name)


sys.meta_path.insert(0, _Hide())
