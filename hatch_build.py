"""Hatch build hook: compile the custom-call libraries (custom_calls/build.py) into
zaya_jax/ops/_lib when the package is built or installed (``pip install``, editable included).

``ZAYA_KERNELS=off`` skips the build; ``ZAYA_KERNELS=require`` makes a failed CPU build an error
(the default, ``auto``, only warns: the package then runs its pure-JAX references).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class KernelsBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        mode = os.environ.get("ZAYA_KERNELS", "auto")
        if self.target_name != "wheel" or mode == "off":
            return
        root = Path(self.root)
        spec = importlib.util.spec_from_file_location(
            "zaya_custom_calls_build", root / "custom_calls" / "build.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out = root / "zaya_jax" / "ops" / "_lib"
        try:
            built = module.build(
                out, os.environ.get("ZAYA_GPU", "auto"), require=mode == "require", log=self.app.display_info
            )
        except RuntimeError as err:
            if mode == "require":
                raise
            self.app.display_warning(f"zaya kernels not built ({err}); the pure-JAX references will run")
            return
        if built:
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            build_data["artifacts"].extend(str(path.relative_to(root)) for path in built.values())
            build_data["artifacts"].append(str((out / "build.json").relative_to(root)))  # targets per library
