"""What a module's source binds, imports and declares at its top level, read with ``ast`` and never
run: the facts lmlab.plugin_source keeps per file. Parsing happens only for files its cache has not
seen, so this module is imported only then."""

import ast

# Names through which a module can bind what its source does not show: do not say it lacks a name.
_DYNAMIC = {"globals", "exec", "eval", "setattr", "vars"}


def read_facts(source: bytes, path: str) -> dict:
    """What a module's top level binds and imports for certain: statements under if/try/with/for run
    only maybe (``try: import x`` / ``except ImportError``), so their names count as bound but unknown
    and their imports as optional."""
    try:
        tree = ast.parse(source, path)
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes
        where = f", line {exc.lineno}" if getattr(exc, "lineno", None) else ""
        return {"error": f"{type(exc).__name__} in {path}{where}: {getattr(exc, 'msg', exc)}"}
    names, imports = {}, []
    dynamic = any(isinstance(node, ast.Global) or (isinstance(node, ast.Name) and node.id in _DYNAMIC)
                  or (isinstance(node, ast.alias) and node.name == "*") for node in ast.walk(tree))

    def visit(body, sure: bool) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    names[bound] = ["module", alias.name if alias.asname else bound] if sure else ["other"]
                    if sure:
                        imports.append([alias.name, 0])
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    names[alias.asname or alias.name] = (["from", node.module or "", node.level, alias.name]
                                                         if sure else ["other"])
                if sure:
                    imports.append([node.module or "", node.level])
            elif isinstance(node, ast.ClassDef):
                names[node.name] = ["class", _class_facts(node)] if sure else ["other"]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = ["other"]
            else:
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                        names[sub.id] = ["other"]
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for part in getattr(node, field, ()):
                        visit(part.body if isinstance(part, (ast.excepthandler, ast.match_case)) else [part],
                              False)

    visit(tree.body, True)
    names.pop("*", None)
    return {"names": names, "imports": imports, "dynamic": dynamic or "__getattr__" in names}  # PEP 562


def _class_facts(node: ast.ClassDef) -> dict:
    """Bases as dotted names (None: an expression such as Generic[T]); ``api`` when the body sets it:
    the string, or None when it is not a literal."""
    facts: dict = {"bases": [_dotted(base) for base in node.bases]}
    for statement in node.body:
        value = statement.value if isinstance(statement, (ast.Assign, ast.AnnAssign)) else None
        targets = (statement.targets if isinstance(statement, ast.Assign)
                   else [statement.target] if isinstance(statement, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "api" for t in targets):
            literal = isinstance(value, ast.Constant) and isinstance(value.value, str)
            facts["api"] = value.value if literal else None
        elif not targets and any(isinstance(sub, ast.Name) and sub.id == "api" and isinstance(sub.ctx, ast.Store)
                                 for sub in ast.walk(statement)):
            facts["api"] = None  # set under an if or in a loop
    return facts


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None
