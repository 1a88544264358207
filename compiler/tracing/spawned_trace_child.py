"""The first step of a spawned trace process (spawned_trace.py): run by path, stdlib only.

    python spawned_trace_child.py BUILD_FOLDER

It lowers its priority first (importing torch takes seconds of a core the caller's model is using), takes the
caller's import path, loads the packages the caller had loaded from a path under a name the import path does not
give (ComfyUI names a custom node pack by its folder), then imports spawned_trace under the caller's name for it
and hands over to its `child_main`, which never returns.
"""

import importlib
import importlib.util
import json
import sys
from pathlib import Path


def main(folder: Path) -> None:
    job = json.loads((folder / "trace-job.json").read_text())
    spec = importlib.util.spec_from_file_location("keepfast_child_priority",
                                                  Path(__file__).resolve().parent.parent / "build_process" / "child_priority.py")
    priority = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(priority)
    priority.lower()
    sys.path[:] = job["sys_path"]
    for name, (origin, locations) in job["packages"].items():
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, origin, submodule_search_locations=locations)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    importlib.import_module(job["entry"]).child_main(folder, int(job["parent"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
