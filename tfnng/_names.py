"""Unique display names: Keras paths need not be unique (two layers of a subclassed model may share a
name), and tfnng keys its records and posterior parts by name."""


def variable_path(variable):
    """A Keras variable's path; a plain ``tf.Variable`` (hand-written loops) has only a name."""
    return getattr(variable, "path", variable.name)


def layer_paths(variables):
    """Sorted paths of the layers holding ``variables`` (each variable's path without its last
    part), for messages naming layers."""
    return sorted({variable_path(v).rsplit("/", 1)[0] for v in variables})


def unique_names(names):
    """``names`` with repeats made unique by a suffix: ``["a", "a", "b"] -> ["a", "a_1", "b"]``."""
    seen, result = set(), []
    for name in names:
        candidate, k = name, 0
        while candidate in seen:
            k += 1
            candidate = f"{name}_{k}"
        seen.add(candidate)
        result.append(candidate)
    return result
