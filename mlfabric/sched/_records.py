"""Hot-path construction of the scheduler's frozen dataclasses (Segment, Transfer, Commit, Update).

A frozen dataclass's __init__ pays an object.__setattr__ per field; the fast path and the simulator
build millions of these small records, and at small batches building them is most of the cost. When
a class is still a plain frozen dataclass (no __slots__, no __post_init__), filling the instance
dict directly — as copy and pickle do — gives the same object 1.5-2x cheaper. Should a class change
shape, its own constructor is used instead."""
import dataclasses


def fast_constructor(cls):
    """A function building cls from all its fields, positionally, as cls(*args) would."""
    if not (dataclasses.is_dataclass(cls) and "__slots__" not in vars(cls)
            and not hasattr(cls, "__post_init__")):
        return cls
    names = tuple(f.name for f in dataclasses.fields(cls))
    new, set_dict = object.__new__, object.__setattr__

    def build(*args):
        obj = new(cls)
        set_dict(obj, "__dict__", dict(zip(names, args)))
        return obj
    build.__doc__ = "%s(%s), built by filling its __dict__" % (cls.__name__, ", ".join(names))
    return build
