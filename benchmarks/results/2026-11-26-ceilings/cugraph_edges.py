"""ctypes helpers: list a captured CUDA graph's kernel nodes and edges, turn edges programmatic."""
import ctypes

cuda = ctypes.CDLL("libcuda.so.1")
c_void_p, c_uint, byref = ctypes.c_void_p, ctypes.c_uint, ctypes.byref


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class KernelParams(ctypes.Structure):
    _fields_ = [("func", c_void_p), ("gx", c_uint), ("gy", c_uint), ("gz", c_uint), ("bx", c_uint), ("by", c_uint),
                ("bz", c_uint), ("smem", c_uint), ("params", c_void_p), ("extra", c_void_p), ("kern", c_void_p),
                ("ctx", c_void_p)]


def check(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


def edges(graph):
    n = ctypes.c_size_t(0)
    check(cuda.cuGraphGetEdges_v2(c_void_p(graph), None, None, None, byref(n)), "cuGraphGetEdges_v2 count")
    frm, to, data = (c_void_p * n.value)(), (c_void_p * n.value)(), (EdgeData * n.value)()
    check(cuda.cuGraphGetEdges_v2(c_void_p(graph), frm, to, data, byref(n)), "cuGraphGetEdges_v2")
    return [(frm[i], to[i], data[i]) for i in range(n.value)]


def node_name(node):
    t = ctypes.c_int(-1)
    check(cuda.cuGraphNodeGetType(c_void_p(node), byref(t)), "type")
    if t.value != 0:
        return None
    p = KernelParams()
    check(cuda.cuGraphKernelNodeGetParams_v2(c_void_p(node), byref(p)), "params")
    name = ctypes.c_char_p()
    if p.func:
        check(cuda.cuFuncGetName(byref(name), c_void_p(p.func)), "cuFuncGetName")
    else:
        check(cuda.cuKernelGetName(byref(name), c_void_p(p.kern)), "cuKernelGetName")
    return name.value.decode()


def make_programmatic(graph, into=lambda name: name.startswith("nvjet")):
    """Every default edge kernel -> kernel whose destination's name passes `into` becomes programmatic."""
    names = {}
    changed = 0
    for a, b, d in edges(graph):
        for n in (a, b):
            if n not in names:
                names[n] = node_name(n)
        if names[a] is None or names[b] is None or not into(names[b]) or d.type != 0:
            continue
        fa, fb = (c_void_p * 1)(a), (c_void_p * 1)(b)
        old = (EdgeData * 1)(d)
        check(cuda.cuGraphRemoveDependencies_v2(c_void_p(graph), fa, fb, old, ctypes.c_size_t(1)), "remove")
        new = (EdgeData * 1)()
        new[0].from_port, new[0].to_port, new[0].type = 1, 0, 1
        check(cuda.cuGraphAddDependencies_v2(c_void_p(graph), fa, fb, new, ctypes.c_size_t(1)), "add")
        changed += 1
    return changed, names


def describe(graph):
    out = []
    for a, b, d in edges(graph):
        out.append((node_name(a), node_name(b), d.type, d.from_port))
    return out
