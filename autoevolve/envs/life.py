"""LifeEnv: an offline, seeded life-services world (restaurants, hotels, rides, calendar) for a tool-using agent.

Tier 1 asks for one call whose arguments are all in the request. Tier 2 needs a search first and an id read from its
single match. Tier 3 needs a choice under constraints (best-rated or cheapest), the booking, and a reply naming it.
The scorer is fixed: partial credit is the fraction of goal conditions met by the final bookings and the last reply.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import random
from collections.abc import Sequence
from typing import Any

from autoevolve.envs.life_world import CITIES, CUISINES, HOTELS_PER_CITY, MAX_PARTY, TOOL_SPECS, Desk, World, make_world
from autoevolve.records import Message, Split, Task, ToolCall

TODAY = dt.date(2026, 12, 1)
USERS = ("Ana", "Ben", "Chloe", "Diego", "Emma", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kai", "Lena")
EVENT_TITLES = (
    "Dentist", "Team meeting", "Yoga class", "Call with Mom", "Haircut", "Gym", "Book club", "Car service",
    "Piano lesson", "Doctor appointment", "Lunch with Sam", "Parent-teacher meeting", "Vet visit", "Tax advisor",
)  # fmt: skip
# Drawn in this order so that the held-out splits stay the same when only n_train changes.
SPLIT_ORDER: tuple[Split, ...] = ("test", "dev", "train")
TIER1_KINDS = ("table", "ride", "event", "hotel", "table")
FIELDS = {
    "table": ("party_size", "time"),
    "hotel": ("check_in", "nights", "guests"),
    "ride": ("pickup", "dropoff", "time"),
    "event": ("title", "date", "time"),
}
ENTITY = {"table": "restaurant_id", "hotel": "hotel_id"}
BOOK_TOOL = {"table": "book_table", "hotel": "book_hotel", "ride": "request_ride", "event": "add_event"}
SEARCH_TOOL = {"table": "search_restaurants", "hotel": "search_hotels"}

TEMPLATES: dict[str, tuple[str, ...]] = {
    "table1": (
        "Book a table for {people} at {name} ({id}) at {time}.",
        "Please reserve a table at {name} ({id}) for {people} at {time}.",
        "Can you book {id} ({name}) for a party of {n} at {time}?",
        "I'd like a table for {people} at {time} at {name}, restaurant id {id}.",
        "Reserve {name} ({id}) at {time} for {people}.",
    ),
    "ride1": (
        "Please get me a ride from {pickup} to {dropoff} at {time}.",
        "I need a ride from {pickup} to {dropoff} at {time}.",
        "Book a ride at {time} from {pickup} to {dropoff}.",
        "Request a car to take me from {pickup} to {dropoff} at {time}.",
        "Can you order a ride from {pickup} to {dropoff}, pickup at {time}?",
    ),
    "event1": (
        "Add '{title}' to my calendar on {date} at {time}.",
        "Put '{title}' in my calendar for {date} at {time}.",
        "Create a calendar event '{title}' on {date} at {time}.",
        "Schedule '{title}' on {date} at {time}, please.",
    ),
    "hotel1": (
        "Book {name} ({id}) for {guests}, checking in {date} for {nights}.",
        "Please reserve {id} ({name}): check-in {date}, {nights}, {guests}.",
        "I need a room at {name} ({id}) from {date} for {nights}, {guests}.",
        "Book hotel {id} ({name}) with check-in on {date}, {nights}, for {guests}.",
    ),
    "table2": (
        "Find {desc} and book a table for {people} at {time}.",
        "Look for {desc}, then reserve a table for {people} at {time}.",
        "I want to eat at {desc}. Please book a table for {people} at {time}.",
        "Search for {desc} and book it for a party of {n} at {time}.",
    ),
    "hotel2": (
        "Find {desc} and book it for {guests}, checking in {date} for {nights}.",
        "Look for {desc}, then book {nights} from {date} for {guests}.",
        "I need {desc}. Please book it from {date}, {nights}, {guests}.",
        "Search for {desc} and reserve it: check-in {date}, {nights}, {guests}.",
    ),
    "hotel2name": (
        "Book {name} in {city} for {guests}, checking in {date} for {nights}.",
        "Find {name} in {city} and reserve it from {date}, {nights}, {guests}.",
        "I'd like to stay at {name} in {city}: check-in {date}, {nights}, {guests}.",
        "Look up {name} in {city} and book {nights} from {date} for {guests}.",
    ),
    "table3": (
        "Book {desc} for {people} at {time}, and tell me its name.",
        "Find {desc} and reserve a table for {people} at {time}. Tell me which restaurant you picked.",
        "I want {desc}: book a table for {n} at {time} and tell me the name.",
        "Please reserve a table for {people} at {time} at {desc}, and let me know its name.",
    ),
    "hotel3": (
        "Book {desc} for {guests}, checking in {date} for {nights}, and tell me its name.",
        "Find {desc} and book it from {date} for {nights}, {guests}. Tell me which hotel you chose.",
        "Reserve {desc}: check-in {date}, {nights}, {guests}. Let me know its name.",
        "Please book {nights} at {desc} from {date} for {guests} and tell me the hotel's name.",
    ),
}

Draft = tuple[str, dict[str, Any]]


def _count(n: int, noun: str) -> str:
    """'1 person', '4 people', '2 nights'."""
    plural = {"person": "people"}.get(noun, noun + "s")
    return f"{n} {noun if n == 1 else plural}"


def _day(rng: random.Random, lo: int, hi: int) -> str:
    """A date between lo and hi days after today."""
    return (TODAY + dt.timedelta(days=rng.randint(lo, hi))).isoformat()


def _quarter(rng: random.Random, first: int, last: int) -> str:
    """A quarter-hour time between two hours."""
    return f"{rng.randint(first, last):02d}:{rng.choice((0, 15, 30, 45)):02d}"


def _restaurant_desc(filters: dict[str, Any], lead: str) -> str:
    """'a vegetarian Italian restaurant in Lisbon with a price level of at most 2' (lead is 'a' or 'the ...')."""
    words = " ".join(w for w in ("vegetarian" if filters.get("vegetarian") else "", filters.get("cuisine", "")) if w)
    noun = f"{words} restaurant" if words else "restaurant"
    if lead == "a":
        lead = "an" if noun[0] in "AEIOUaeiou" else "a"
    price = f" with a price level of at most {filters['max_price']}" if "max_price" in filters else ""
    return f"{lead} {noun} in {filters['city']}{price}"


def _hotel_desc(filters: dict[str, Any], lead: str) -> str:
    """'a hotel in Porto that costs at most 90 per night' (lead is 'a' or 'the ...')."""
    price = f" that costs at most {filters['max_price']} per night" if "max_price" in filters else ""
    return f"{lead} hotel in {filters['city']}{price}"


class _Drafter:
    """Draws (request, goal) pairs for one world; the searchable constraint combos are found once."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.unique_restaurants = [f for f in self._restaurant_filters() if len(world.find_restaurants(**f)) == 1]
        self.unique_restaurants = [f for f in self.unique_restaurants if "cuisine" in f]
        self.unique_hotels = [f for f in self._hotel_filters() if len(world.find_hotels(**f)) == 1]
        self.best_restaurants = [c for f in self._restaurant_filters() for c in self._choices(f, "restaurant")]
        self.best_hotels = [c for f in self._hotel_filters() for c in self._choices(f, "hotel")]

    @staticmethod
    def _restaurant_filters() -> list[dict[str, Any]]:
        """Every search a request may describe: city with optional cuisine, vegetarian and price cap."""
        combos = [
            {"city": city, "cuisine": cuisine, "vegetarian": veg, "max_price": price}
            for city in CITIES
            for cuisine in (None, *CUISINES)
            for veg in (None, True)
            for price in (None, 1, 2, 3)
        ]
        return [{k: v for k, v in c.items() if v is not None} for c in combos]

    def _hotel_filters(self) -> list[dict[str, Any]]:
        """City searches with round price caps; one cap per distinct match set, so no hotel is over-drawn."""
        filters: list[dict[str, Any]] = []
        for city in CITIES:
            seen: set[frozenset[str]] = set()
            for cap in (None, *range(60, 330, 10)):
                f = {"city": city} if cap is None else {"city": city, "max_price": cap}
                ids = frozenset(h.id for h in self.world.find_hotels(**f))
                if ids and ids not in seen and (cap is None or len(ids) < HOTELS_PER_CITY):
                    seen.add(ids)
                    filters.append(f)
        return filters

    def _choices(self, filters: dict[str, Any], what: str) -> list[tuple[dict[str, Any], str, Any]]:
        """(filters, objective, winner) for each objective with a unique winner among two or more matches."""
        found: list[Any] = (
            self.world.find_restaurants(**filters) if what == "restaurant" else self.world.find_hotels(**filters)
        )
        if len(found) < 2:
            return []
        price = (lambda x: x.price) if what == "restaurant" else (lambda x: x.price_per_night)
        keys = {"best-rated": lambda x: -x.rating}
        if "max_price" not in filters:  # "the cheapest ... costing at most N" reads oddly
            keys["cheapest"] = price
        out = []
        for objective, key in keys.items():
            ranked = sorted(found, key=key)
            if key(ranked[0]) != key(ranked[1]):
                out.append((filters, objective, ranked[0]))
        return out

    def draw(self, tier: int, rng: random.Random, k: int) -> Draft:
        """The k-th draft of a tier; k rotates the kinds so every split gets a mix."""
        if tier == 1:
            return getattr(self, f"_{TIER1_KINDS[k % len(TIER1_KINDS)]}1")(rng)
        kind = "hotel" if k % 3 == 2 else "table"
        return getattr(self, f"_{kind}{tier}")(rng)

    def _table1(self, rng: random.Random) -> Draft:
        """Book a named restaurant by id."""
        r = rng.choice(self.world.restaurants)
        n, time = rng.randint(1, MAX_PARTY), rng.choice(r.slots())
        words = {"people": _count(n, "person"), "n": n, "name": r.name, "id": r.id, "time": time}
        request = rng.choice(TEMPLATES["table1"]).format(**words)
        return request, {"kind": "table", "restaurant_id": r.id, "name": r.name, "party_size": n, "time": time}

    def _ride1(self, rng: random.Random) -> Draft:
        """Order a ride between two places of one city."""
        city = rng.choice(CITIES)
        places = [f"{city} Airport", f"{city} Central Station", f"{city} Old Town"]
        places += [h.name for h in self.world.find_hotels(city)]
        pickup, dropoff = rng.sample(places, 2)
        time = _quarter(rng, 6, 22)
        request = rng.choice(TEMPLATES["ride1"]).format(pickup=pickup, dropoff=dropoff, time=time)
        return request, {"kind": "ride", "pickup": pickup, "dropoff": dropoff, "time": time}

    def _event1(self, rng: random.Random) -> Draft:
        """Add a calendar event."""
        title, date, time = rng.choice(EVENT_TITLES), _day(rng, 1, 45), _quarter(rng, 7, 20)
        request = rng.choice(TEMPLATES["event1"]).format(title=title, date=date, time=time)
        return request, {"kind": "event", "title": title, "date": date, "time": time}

    def _stay(self, rng: random.Random) -> tuple[str, int, int, dict[str, str]]:
        """Check-in, nights, guests and their phrasings for a hotel request."""
        date, nights, guests = _day(rng, 1, 60), rng.randint(1, 7), rng.randint(1, 4)
        words = {"date": date, "nights": _count(nights, "night"), "guests": _count(guests, "guest")}
        return date, nights, guests, words

    def _hotel_goal(self, hotel: Any, date: str, nights: int, guests: int) -> dict[str, Any]:
        """The goal for a hotel stay."""
        goal = {"kind": "hotel", "hotel_id": hotel.id, "name": hotel.name, "check_in": date}
        return goal | {"nights": nights, "guests": guests}

    def _hotel1(self, rng: random.Random) -> Draft:
        """Book a named hotel by id."""
        h = rng.choice(self.world.hotels)
        date, nights, guests, words = self._stay(rng)
        request = rng.choice(TEMPLATES["hotel1"]).format(name=h.name, id=h.id, **words)
        return request, self._hotel_goal(h, date, nights, guests)

    def _table2(self, rng: random.Random) -> Draft:
        """Search restaurants (one match) and book it."""
        filters = rng.choice(self.unique_restaurants)
        (r,) = self.world.find_restaurants(**filters)
        n, time = rng.randint(1, MAX_PARTY), rng.choice(r.slots())
        desc = _restaurant_desc(filters, "a")
        request = rng.choice(TEMPLATES["table2"]).format(desc=desc, people=_count(n, "person"), n=n, time=time)
        goal = {"kind": "table", "restaurant_id": r.id, "name": r.name, "party_size": n, "time": time}
        return request, {**goal, "search": filters}

    def _hotel2(self, rng: random.Random) -> Draft:
        """Search hotels and book the one match, or the one named in the request (its id is only in the result)."""
        date, nights, guests, words = self._stay(rng)
        if rng.random() < 0.5:
            filters = rng.choice(self.unique_hotels)
            (h,) = self.world.find_hotels(**filters)
            request = rng.choice(TEMPLATES["hotel2"]).format(desc=_hotel_desc(filters, "a"), **words)
        else:
            h = rng.choice(self.world.hotels)
            filters = {"city": h.city}
            request = rng.choice(TEMPLATES["hotel2name"]).format(name=h.name, city=h.city, **words)
        return request, {**self._hotel_goal(h, date, nights, guests), "search": filters}

    def _table3(self, rng: random.Random) -> Draft:
        """Pick the best-rated or cheapest matching restaurant, book it, and name it."""
        filters, objective, r = rng.choice(self.best_restaurants)
        n, time = rng.randint(1, MAX_PARTY), rng.choice(r.slots())
        desc = _restaurant_desc(filters, f"the {objective}")
        request = rng.choice(TEMPLATES["table3"]).format(desc=desc, people=_count(n, "person"), n=n, time=time)
        goal = {"kind": "table", "restaurant_id": r.id, "name": r.name, "party_size": n, "time": time}
        return request, {**goal, "search": filters, "mention": r.name, "why": f"the {objective} match"}

    def _hotel3(self, rng: random.Random) -> Draft:
        """Pick the best-rated or cheapest matching hotel, book it, and name it."""
        filters, objective, h = rng.choice(self.best_hotels)
        date, nights, guests, words = self._stay(rng)
        request = rng.choice(TEMPLATES["hotel3"]).format(desc=_hotel_desc(filters, f"the {objective}"), **words)
        goal = self._hotel_goal(h, date, nights, guests)
        return request, {**goal, "search": filters, "mention": h.name, "why": f"the {objective} match"}


def _same(got: Any, want: Any) -> bool:
    """Equal, comparing strings case-insensitively and stripped."""
    if isinstance(got, str) and isinstance(want, str):
        return got.strip().casefold() == want.strip().casefold()
    return got == want


def _final_reply(messages: list[Message]) -> str:
    """The last message's text if it is a plain assistant reply, else ''."""
    if not messages or messages[-1].role != "assistant" or messages[-1].tool_calls:
        return ""
    return messages[-1].content.strip()


def _target(goal: dict[str, Any]) -> str:
    """What the goal asks for, for feedback: 'a table at R-117 (Sakura Garden)'."""
    kind = goal["kind"]
    if kind == "table":
        return f"a table at {goal['restaurant_id']} ({goal['name']})"
    if kind == "hotel":
        return f"a stay at {goal['hotel_id']} ({goal['name']})"
    if kind == "ride":
        return f"a ride from {goal['pickup']} to {goal['dropoff']}"
    return f"a calendar event '{goal['title']}'"


def _booked(booking: dict[str, Any]) -> str:
    """A made booking in words, for feedback on extras."""
    kind = booking["kind"]
    if kind == "table":
        return f"a table at {booking['restaurant_id']} ({booking['restaurant']}) for {booking['party_size']}"
    if kind == "hotel":
        return f"a stay at {booking['hotel_id']} ({booking['hotel']}) from {booking['check_in']}"
    if kind == "ride":
        return f"a ride from {booking['pickup']} to {booking['dropoff']} at {booking['time']}"
    return f"a calendar event '{booking['title']}' on {booking['date']}"


def _checks(goal: dict[str, Any], bookings: list[dict[str, Any]], reply: str) -> list[tuple[bool, str]]:
    """Each goal condition with the sentence to show when it is unmet."""
    kind, fields = goal["kind"], FIELDS[goal["kind"]]
    entity = ENTITY.get(kind)
    # Rides and events have no catalogue entity: any one of the right kind stands in for "the thing asked for".
    on_target = [b for b in bookings if b["kind"] == kind and (entity is None or b[entity] == goal[entity])]
    best = max(on_target, key=lambda b: sum(_same(b[f], goal[f]) for f in fields), default=None)
    why = f", {goal['why']}" if "why" in goal else ""
    verb = "added" if kind == "event" else "booked"
    checks = [(best is not None, f"Expected {_target(goal)}{why}; none was {verb}.")]
    for f in fields:
        got = best[f] if best is not None else "none"
        checks.append((best is not None and _same(got, goal[f]), f"Expected {f} {goal[f]}, got {got}."))
    extras = [b for b in bookings if b is not best]
    listed = "; ".join(_booked(b) for b in extras)
    # Tidiness and the reply earn credit only once the asked-for thing exists: doing nothing must score 0.
    hit = best is not None
    extra_note = f"Made {len(extras)} booking(s) that were not asked for: {listed}." if extras else ""
    checks.append((hit and not extras, extra_note))
    checks.append((hit and bool(reply), "" if reply else "Expected a final reply to the user; none was given."))
    if "mention" in goal:
        named = goal["mention"].casefold() in reply.casefold()
        checks.append((hit and named, "" if named else f"Expected the reply to name {goal['mention']}."))
    return checks


class LifeEpisode:
    """One task in progress: a private booking desk over the shared world, and the fixed scorer."""

    finished = False  # the model always gets to answer the user after a tool result

    def __init__(self, world: World, task: Task) -> None:
        self.task = task
        self.desk = Desk(world, today=str(task.metadata.get("today", TODAY.isoformat())))

    @property
    def bookings(self) -> list[dict[str, Any]]:
        """Successful bookings so far, in order."""
        return [dict(b) for b in self.desk.bookings]

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a tool and return JSON text; domain errors are {'error': ...}; an unknown tool raises KeyError."""
        return self.desk.call(name, arguments)

    def score(self, messages: list[Message]) -> tuple[float, str]:
        """Fraction of goal conditions met, and one sentence per unmet condition ('' at 1.0)."""
        checks = _checks(self.task.goal, self.desk.bookings, _final_reply(messages))
        reward = sum(ok for ok, _ in checks) / len(checks)
        return reward, " ".join(sentence for ok, sentence in checks if not ok and sentence)


def _book_args(goal: dict[str, Any]) -> dict[str, Any]:
    """The acting call's arguments for a goal."""
    fields = FIELDS[goal["kind"]]
    entity = ENTITY.get(goal["kind"])
    return ({entity: goal[entity]} if entity else {}) | {f: goal[f] for f in fields}


def _confirmation(goal: dict[str, Any], result: dict[str, Any]) -> str:
    """The reference's closing reply, built from the booking result."""
    kind = goal["kind"]
    if kind == "table":
        what = f"table for {goal['party_size']} at {goal['name']} ({goal['restaurant_id']}) at {goal['time']}"
    elif kind == "hotel":
        stay = f"{_count(goal['nights'], 'night')} from {goal['check_in']} for {_count(goal['guests'], 'guest')}"
        what = f"{goal['name']} ({goal['hotel_id']}), {stay}"
    elif kind == "ride":
        what = f"ride from {goal['pickup']} to {goal['dropoff']} at {goal['time']}"
    else:
        when = f"on {goal['date']} at {goal['time']}"
        return f"Done: '{goal['title']}' is in your calendar {when} ({result['event_id']})."
    chosen = f" I picked {goal['name']}, {goal['why']}." if "why" in goal else ""
    return f"Done: {what}, booking {result['booking_id']}.{chosen}"


class LifeEnv:
    """Seeded life-services environment: tasks per split, tool specs, episodes and reference solutions."""

    name = "life"

    def __init__(
        self,
        seed: int = 0,
        tiers: Sequence[int] = (1, 2, 3),
        n_train: int = 256,
        n_dev: int = 64,
        n_test: int = 96,
    ) -> None:
        self.seed = seed
        self.tiers = tuple(sorted(set(tiers)))
        if not self.tiers or not set(self.tiers) <= {1, 2, 3}:
            raise ValueError(f"tiers must be a non-empty subset of (1, 2, 3), got {tuple(tiers)}")
        sizes = {"train": n_train, "dev": n_dev, "test": n_test}
        if min(sizes.values()) < 0:
            raise ValueError(f"split sizes must be >= 0, got {sizes}")
        self.world = make_world(seed)
        self._drafter = _Drafter(self.world)
        self._splits = self._build(sizes)

    def tasks(self, split: Split) -> list[Task]:
        """All tasks of a split, tiers interleaved, in a fixed order."""
        if split not in self._splits:
            raise ValueError(f"unknown split {split!r}")
        return list(self._splits[split])

    def tools(self) -> list[dict[str, Any]]:
        """Tool specs in the OpenAI function schema (a fresh copy each call)."""
        return copy.deepcopy(list(TOOL_SPECS))

    def start(self, task: Task) -> LifeEpisode:
        """A fresh episode with its own bookings."""
        if task.env != self.name:
            raise ValueError(f"task {task.id} belongs to env {task.env!r}, not {self.name!r}")
        return LifeEpisode(self.world, task)

    def reference(self, task: Task) -> list[Message] | None:
        """A gold conversation for a train task, with real tool results; None for dev and test."""
        if task.split != "train":
            return None
        episode = self.start(task)
        goal = task.goal
        calls = [(SEARCH_TOOL[goal["kind"]], goal["search"])] if "search" in goal else []
        calls.append((BOOK_TOOL[goal["kind"]], _book_args(goal)))
        messages = [Message(role="user", content=task.request)]
        result = ""
        for number, (name, args) in enumerate(calls, start=1):
            call_id = f"call_{number}"
            result = episode.call(name, args)
            messages.append(Message(role="assistant", tool_calls=[ToolCall.make(call_id, name, args)]))
            messages.append(Message(role="tool", tool_call_id=call_id, content=result))
        messages.append(Message(role="assistant", content=_confirmation(goal, json.loads(result))))
        return messages

    def _build(self, sizes: dict[str, int]) -> dict[str, list[Task]]:
        """Lay tiers out round-robin in each split and fill the slots from per-tier pools of distinct requests."""
        layout = {split: [self.tiers[i % len(self.tiers)] for i in range(sizes[split])] for split in SPLIT_ORDER}
        need = {tier: sum(slots.count(tier) for slots in layout.values()) for tier in self.tiers}
        pools = {tier: self._pool(tier, need[tier]) for tier in self.tiers}
        taken = dict.fromkeys(self.tiers, 0)
        splits: dict[str, list[Task]] = {}
        for split in SPLIT_ORDER:
            tasks = []
            for tier in layout[split]:
                number = taken[tier]
                taken[tier] += 1
                request, goal, metadata = pools[tier][number]
                tasks.append(
                    Task(
                        id=f"life-{tier}-{number:05d}",
                        env=self.name,
                        split=split,
                        tier=tier,
                        request=request,
                        metadata=metadata,
                        goal=goal,
                    )
                )
            splits[split] = tasks
        return splits

    def _pool(self, tier: int, size: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
        """`size` drafts of one tier with distinct request texts, from the tier's own seeded stream."""
        rng = random.Random(f"life:{self.seed}:tier{tier}")
        seen: set[str] = set()
        pool: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        for _ in range(50 * size + 1000):
            if len(pool) == size:
                break
            request, goal = self._drafter.draw(tier, rng, len(pool))
            if request not in seen:
                seen.add(request)
                pool.append((request, goal, {"today": TODAY.isoformat(), "user": rng.choice(USERS)}))
        if len(pool) < size:
            raise ValueError(f"could only draw {len(pool)} distinct tier-{tier} tasks, {size} needed")
        return pool
