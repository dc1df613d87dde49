"""Probe only: with MINIVLLM_PROBE_NO_NORM=1, ops.add_rms_norm launches nothing for CUDA steps of at
most 256 rows (returns x as the normed input and leaves the residual alone). Outputs are wrong; the
step's other kernels keep their shapes, so the run's time bounds what removing the decode-step norm
kernels could save."""
import importlib.abc, importlib.util, os, sys

TARGET = "minivllm.worker.ops"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        real = module.add_rms_norm

        def add_rms_norm(x, weight, eps, residual=None):
            if x.is_cuda and x.shape[0] <= 256:
                return x, (residual if residual is not None else x)
            return real(x, weight, eps, residual)
        module.add_rms_norm = add_rms_norm
        print("PROBE: add_rms_norm skipped for <= 256 rows", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("MINIVLLM_PROBE_NO_NORM") == "1":
    sys.meta_path.insert(0, _Finder())
