import os
if os.environ.get("FORCE_ROWS2"):
    import importlib.abc, sys
    def patch():
        import pymooncake.engine.kernels.decode_layers as d
        d.decode_rows_max = lambda *a, **k: 2
    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "pymooncake.engine.kernels.decode_layers":
                sys.meta_path.remove(self)
                import importlib.util
                spec = importlib.util.find_spec(name)
                orig = spec.loader.exec_module
                def exec_module(m):
                    orig(m); m.decode_rows_max = lambda *a, **k: 2
                spec.loader.exec_module = exec_module
                return spec
            return None
    sys.meta_path.insert(0, Finder())
