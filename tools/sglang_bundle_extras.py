"""Complete the SGLang device bundle (.carry/sglang, built by ../shared/tools/sglang-device-bundle) with the modules the
GPU tests' SGLang-built metadata needs beyond the bundle's file list: sglang/srt/mem_cache/kv_index_translator.py and
what it imports. Run here, where SGLang 0.5.23 is installed (bash ci/install.sh), before a device run:

    python tools/sglang_bundle_extras.py [.carry/sglang]

It imports those modules from the installed SGLang as the CPU tests do (tests/sglang_env.py) and copies every SGLang
source file that got imported and is missing from the bundle's src/ tree; it prints what it copied.
"""
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDED = ["sglang.srt.mem_cache.kv_index_translator", "sglang.srt.layers.attention.verify_mask",
          "sglang.srt.speculative.eagle_utils"]


def main():
    bundle = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".carry", "sglang")
    dest = os.path.join(bundle, "src")
    if not os.path.isdir(os.path.join(dest, "sglang")):
        sys.exit(f"sglang_bundle_extras.py: no bundle at {bundle} (run ../shared/tools/sglang-device-bundle first)")
    os.environ.setdefault("TRITON_INTERPRET", "1")   # as tests/conftest.py: SGLang imports on a machine without a GPU
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from sglang_env import import_sglang

    import_sglang()
    import importlib

    for name in NEEDED:
        importlib.import_module(name)
    site = os.path.dirname(os.path.dirname(sys.modules["sglang"].__file__))
    copied = 0
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not name.startswith("sglang") or not path or not path.startswith(site):
            continue
        rel = os.path.relpath(path, site)
        target = os.path.join(dest, rel)
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(path, target)
            copied += 1
            print(rel)
    print(f"sglang_bundle_extras.py: {copied} files copied into {dest}")


if __name__ == "__main__":
    main()
