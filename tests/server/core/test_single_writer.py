"""One writer of sequence state: the scheduler.

Read from the source with ``ast`` (nothing is imported): outside the scheduler's modules and
``sequence.py`` itself, no code of ``server/`` assigns, augments or deletes a field of a
:class:`Sequence` or :class:`SequenceGroup`, mutates one of their lists in place, or calls one
of their mutating methods. The fields and the mutating methods are read from ``sequence.py``,
so a new field or method is covered without editing this test.

NOTE: the scan goes by attribute name. A class writing its *own* field of the same name
(``self.status`` of an HTTP error) is not a sequence; the few other objects with such a
field, written through another name, are listed in ``OTHER_OBJECTS``.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]
SERVER = ROOT / "server"
SEQUENCE_MODULE = "server/core/sequence.py"
OWNERS = {"server/core/scheduler.py", "server/core/sequence_updates.py", SEQUENCE_MODULE}
"""The scheduler's modules (and the sequence's own): the only ones that change sequence state."""
STATE_CLASSES = ("Sequence", "SequenceGroup")
IDENTITY_FIELDS = {"seq_id", "request_id", "prompt", "arrival_time"}
"""Fields set once at construction whose names other objects share; never written after."""
EXTRA_FIELDS = {"_token_ids", "token_ids"}
"""State behind properties: the token list that ``token_ids`` returns."""
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "update", "setdefault"}
OTHER_OBJECTS = {
    ("server/engine/output_deltas.py", "delta", "prompt_logprobs"),  # a RequestDelta being built
    ("server/engine/output_deltas.py", "delta", "prompt_token_ids"),
    ("server/engine/output_deltas.py", "state", "prompt_logprobs"),  # the front end's accumulated request
    ("server/engine/output_deltas.py", "choice", "token_ids"),  # ... and its completions
    ("server/entrypoints/openai/metrics.py", "stream", "first_token_time"),  # a RequestStream's timing
}
"""(module, receiver, field): objects of other classes, written through a name other than ``self``."""


def state_fields(source: str) -> set[str]:
    """The fields of the sequence classes in ``source`` (their annotated class-level names)."""
    fields = set(EXTRA_FIELDS)
    for cls in _state_classes(ast.parse(source)):
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields.add(stmt.target.id)
    return fields - IDENTITY_FIELDS


def mutating_methods(source: str) -> set[str]:
    """Methods of the sequence classes that write an attribute of ``self`` (construction aside)."""
    names = set()
    for cls in _state_classes(ast.parse(source)):
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name != "__post_init__" and _writes_self(fn):
                names.add(fn.name)
    return names


def _state_classes(tree: ast.Module) -> list[ast.ClassDef]:
    return [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in STATE_CLASSES]


def _writes_self(fn: ast.FunctionDef) -> bool:
    for node in ast.walk(fn):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                return True
        if _mutated_attribute(node) is not None:
            receiver = node.func.value.value  # type: ignore[attr-defined]
            if isinstance(receiver, ast.Name) and receiver.id == "self":
                return True
    return False


def _targets(node: ast.AST) -> list[ast.expr]:
    """What ``node`` assigns or deletes, tuples unpacked and subscripts reduced to what they index."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, ast.Subscript):
            targets.append(target.value)
        else:
            flat.append(target)
    return flat


def _mutated_attribute(node: ast.AST) -> ast.Attribute | None:
    """``x.attr`` when ``node`` is ``x.attr.append(...)`` (or another in-place list method)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        value = node.func.value
        if isinstance(value, ast.Attribute):
            return value
    return None


class _Scan(ast.NodeVisitor):
    def __init__(self, module: str, fields: set[str], methods: set[str]) -> None:
        self.module, self.fields, self.methods = module, fields, methods
        self.classes: list[str] = []
        self.found: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def generic_visit(self, node: ast.AST) -> None:
        for target in _targets(node):
            if isinstance(target, ast.Attribute):
                self._check(node, target, "writes")
        attribute = _mutated_attribute(node)
        if attribute is not None:
            self._check(node, attribute, f"calls .{node.func.attr}() on")  # type: ignore[attr-defined]
        if isinstance(node, ast.Call):
            self._check_call(node)
        super().generic_visit(node)

    def _check(self, node: ast.AST, target: ast.Attribute, verb: str) -> None:
        if target.attr not in self.fields:
            return
        receiver = ast.unparse(target.value)
        own_field = receiver == "self" and not set(self.classes) & set(STATE_CLASSES)
        if own_field or (self.module, receiver, target.attr) in OTHER_OBJECTS:
            return
        self.found.append(f"{self.module}:{node.lineno}: {verb} {receiver}.{target.attr}")

    def _check_call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in self.methods:
            self.found.append(f"{self.module}:{node.lineno}: calls {ast.unparse(func)}()")
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in self.fields:
                self.found.append(f"{self.module}:{node.lineno}: calls {func.id}() on {ast.unparse(node.args[0])}")


def violations(module: str, source: str, fields: set[str], methods: set[str]) -> list[str]:
    """Writes of sequence state in ``source`` (the module at path ``module``), unless it is an owner."""
    if module in OWNERS:
        return []
    scan = _Scan(module, fields, methods)
    scan.visit(ast.parse(source))
    return scan.found


def scan_server() -> list[str]:
    sequence_source = (ROOT / SEQUENCE_MODULE).read_text()
    fields, methods = state_fields(sequence_source), mutating_methods(sequence_source)
    found = []
    for path in sorted(SERVER.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        found += violations(module, path.read_text(), fields, methods)
    return found


def _fields_and_methods() -> tuple[set[str], set[str]]:
    source = (ROOT / SEQUENCE_MODULE).read_text()
    return state_fields(source), mutating_methods(source)


def test_only_the_scheduler_writes_sequence_state():
    assert scan_server() == []


def test_the_scan_knows_the_state_and_the_methods_that_change_it():
    fields, methods = _fields_and_methods()
    expected = {"status", "num_computed_tokens", "spec_token_ids", "output_token_ids", "cumulative_logprob", "seqs"}
    assert expected <= fields
    assert {"output_logprobs", "output_text", "stop_reason", "hypotheses", "prompt_logprobs"} <= fields
    assert {"append_token", "reset_for_recompute"} <= methods
    assert "fork" not in methods and "get_seqs" not in methods  # they read their sequence only


PLANTED = """
class Decider:
    def __init__(self):
        self.status = "own field: fine"

    def decide(self, seq, group, tokens):
        ok = seq.status
        seq.status = 1
        seq.num_computed_tokens += 1
        seq.spec_token_ids[:] = []
        seq.prefix_offset, seq.read_offset = 0, 1
        group.seqs.append(seq)
        seq.output_token_ids.extend(tokens)
        seq.token_ids.pop()
        del group.seqs[0]
        seq.append_token(1, None, None)
        setattr(seq, "cumulative_logprob", 0.0)
"""


def test_a_planted_write_is_found_anywhere_outside_the_scheduler():
    fields, methods = _fields_and_methods()
    found = violations("server/engine/planted.py", PLANTED, fields, methods)
    assert [line.split(":", 2)[2].strip() for line in found] == [
        "writes seq.status",
        "writes seq.num_computed_tokens",
        "writes seq.spec_token_ids",
        "writes seq.read_offset",
        "writes seq.prefix_offset",
        "calls .append() on group.seqs",
        "calls .extend() on seq.output_token_ids",
        "calls .pop() on seq.token_ids",
        "writes group.seqs",
        "calls seq.append_token()",
        "calls setattr() on seq",
    ]
    assert violations("server/core/sequence_updates.py", PLANTED, fields, methods) == []  # the owner may


def test_a_planted_write_inside_a_sequence_class_elsewhere_is_found():
    fields, methods = _fields_and_methods()
    source = "class Sequence:\n    def bump(self):\n        self.num_computed_tokens += 1\n"
    assert len(violations("server/engine/copy.py", source, fields, methods)) == 1
