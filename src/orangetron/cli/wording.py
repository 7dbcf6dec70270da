"""How the command lines word a count: "1 document", "2 documents", "1,024 tokens"."""


def counted(number: int, noun: str, plural: str | None = None) -> str:
    """`number` (with thousands separators) and `noun`, in the plural (`plural`, else noun + "s") unless one."""
    return f"{number:,} {noun if number == 1 else plural or noun + 's'}"
