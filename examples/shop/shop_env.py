"""A shop's stock room, written for TRL's ``GRPOTrainer(environment_factory=ShopEnv)``; autoevolve runs it as it is.

TRL's protocol: ``reset(**row)`` starts an episode from a dataset row, every public method is a tool (its schema
comes from its signature and docstring), ``get_reward()`` scores the finished episode. ``feedback()`` is optional:
autoevolve's reflective mutator reads it; without it, the feedback states the reward.
"""

from __future__ import annotations

STOCK = {"apples": 12, "pears": 4, "plums": 0, "lemons": 7, "eggs": 30, "bread": 5, "milk": 9, "rice": 2, "tea": 15}


class ShopEnv:
    """One customer's order: the right item in the right quantity, from what is in stock."""

    def __init__(self) -> None:
        self.stock: dict[str, int] = {}
        self.orders: list[tuple[str, int]] = []
        self.want: tuple[str, int] = ("", 0)

    def reset(self, **row) -> str | None:
        """Start from a dataset row (its 'item' and 'quantity' are what the customer wants)."""
        self.stock, self.orders, self.want = dict(STOCK), [], (row["item"], int(row["quantity"]))
        return None

    def check_stock(self, item: str) -> str:
        """Check how many of an item the shop has in stock.

        Args:
            item: The item's name in lower case, e.g. "apples".

        Returns:
            How many are in stock.
        """
        if item not in self.stock:
            raise ValueError(f"the shop does not sell {item!r}")
        return f"{self.stock[item]} {item} in stock"

    def order(self, item: str, quantity: int) -> str:
        """Order an item for the customer.

        Args:
            item: The item's name in lower case, e.g. "apples".
            quantity: How many to order.

        Returns:
            The order's confirmation.
        """
        if item not in self.stock:
            raise ValueError(f"the shop does not sell {item!r}")
        if quantity > self.stock[item]:
            raise ValueError(f"only {self.stock[item]} {item} in stock")
        self.stock[item] -= quantity
        self.orders.append((item, quantity))
        return f"Ordered {quantity} {item} (order {len(self.orders)})."

    def get_reward(self) -> float:
        """1 for exactly the wanted order, 0.5 for the right item in another quantity, else 0."""
        if self.orders == [self.want]:
            return 1.0
        return 0.5 if [item for item, _ in self.orders] == [self.want[0]] else 0.0

    def feedback(self) -> str:
        """What went wrong, in a sentence the reflective mutator can act on."""
        item, quantity = self.want
        if self.orders == [self.want]:
            return ""
        made = ", ".join(f"order({i!r}, {q})" for i, q in self.orders) or "no order"
        return f"The customer wanted order(item={item!r}, quantity={quantity}) once; the model made {made}."
