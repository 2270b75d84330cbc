"""How genq writes money for people: integer nanos as a decimal amount of the currency unit.

One module for every place that shows money: the operators' `genq` commands, and the service's
status page and log lines.
"""

from __future__ import annotations

from decimal import Decimal


def money(nanos: int, currency: str = "", *, grouped: bool = False) -> str:
    """Integer nanos as a decimal amount of the currency unit, at least two decimals and more
    when the amount has them, never rounded, through `Decimal` (never a float): 2500000000 ->
    "2.50", 1234567891 -> "1.234567891". `grouped` separates the thousands (1,234.50), for
    people rather than for commands to read back."""
    whole, _, fraction = f"{Decimal(nanos).scaleb(-9):f}".partition(".")
    if grouped:
        whole = f"{int(whole):,}" if whole != "-0" else whole
    text = f"{whole}.{fraction.rstrip('0').ljust(2, '0')}"
    return f"{text} {currency}" if currency else text
