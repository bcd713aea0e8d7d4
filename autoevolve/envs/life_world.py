"""The life-services world: cities, restaurants and hotels, and the booking desk whose tools act on them.

The world is generated once from a seed and never changes; each episode gets its own ``Desk`` holding its bookings.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Any

CITIES = ("Lisbon", "Porto", "Madrid", "Paris", "Rome", "Berlin")
CUISINES = ("Italian", "Japanese", "Mexican", "Indian", "French", "Thai")
ADJECTIVES = (
    "Golden", "Silver", "Blue", "Green", "Red", "Little", "Old", "Royal",
    "Happy", "Lucky", "Hidden", "Sunny", "Quiet", "Wild", "Rustic", "Urban",
)  # fmt: skip
NOUNS = (
    "Lotus", "Garden", "Olive", "Table", "Spoon", "Kitchen", "Lantern", "Harbor",
    "Fig", "Oak", "Pepper", "Basil", "Bistro", "Corner", "Terrace", "Mill",
)  # fmt: skip
HOTEL_WORDS = (
    "Avenida", "Central", "Miramar", "Aurora", "Imperial", "Royal", "Plaza", "Bellevue", "Regina",
    "Atlantico", "Palacio", "Continental", "Majestic", "Victoria", "Florida", "Excelsior", "Savoy", "Astoria",
    "Park", "Riverside", "Harbour", "Metropole", "Splendid", "Panorama", "Belvedere", "Colonial", "Grand",
    "Meridian", "Orient", "Paradiso", "Quinta", "Sol", "Alameda", "Lumiere", "Vista", "Europa",
)  # fmt: skip
OPENS = ("11:00", "11:30", "12:00", "17:00", "18:00")
CLOSES = ("21:00", "22:00", "22:30", "23:00", "23:30")
RESTAURANTS_PER_CITY = 16
HOTELS_PER_CITY = 6
MAX_PARTY = 8  # requests never ask for more; seats always cover it so only the model can hit "too many people"

TIME_RE = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")
DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def minutes(hhmm: str) -> int:
    """Minutes since midnight of a normalised 'HH:MM' time."""
    hours, mins = hhmm.split(":")
    return int(hours) * 60 + int(mins)


def clock(total: int) -> str:
    """'HH:MM' for minutes since midnight."""
    return f"{total // 60:02d}:{total % 60:02d}"


def parse_time(value: Any) -> str | None:
    """Normalise 'HH:MM' or 'H:MM' to 'HH:MM'; None for anything else (no '7pm', no seconds)."""
    match = TIME_RE.match(value.strip()) if isinstance(value, str) else None
    return f"{int(match.group(1)):02d}:{match.group(2)}" if match else None


def parse_date(value: Any) -> str | None:
    """A valid 'YYYY-MM-DD' date as given, else None."""
    if not isinstance(value, str) or not DATE_RE.match(value.strip()):
        return None
    try:
        return dt.date.fromisoformat(value.strip()).isoformat()
    except ValueError:
        return None


def parse_int(value: Any) -> int | None:
    """An integer from an int, an integral float or a digit string; None otherwise (bools are not numbers here)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def parse_bool(value: Any) -> bool | None:
    """A bool from a bool or 'true'/'false'; None otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def text(value: Any) -> str:
    """A stripped string, or '' for anything that is not a string."""
    return value.strip() if isinstance(value, str) else ""


@dataclass(frozen=True)
class Restaurant:
    """One restaurant; price is a level from 1 (cheap) to 4 (expensive)."""

    id: str
    name: str
    city: str
    cuisine: str
    price: int
    rating: float
    opens: str
    closes: str
    vegetarian: bool
    seats: int

    @property
    def hours(self) -> str:
        """Opening hours as 'HH:MM-HH:MM'."""
        return f"{self.opens}-{self.closes}"

    def is_open(self, time: str) -> bool:
        """Whether a table can start at this time."""
        return minutes(self.opens) <= minutes(time) < minutes(self.closes)

    def slots(self) -> list[str]:
        """Quarter-hour start times that leave at least an hour before closing, for generated requests."""
        return [clock(m) for m in range(minutes(self.opens), minutes(self.closes) - 59, 15)]

    def public(self) -> dict[str, Any]:
        """What a search shows."""
        return {
            "id": self.id,
            "name": self.name,
            "cuisine": self.cuisine,
            "price": self.price,
            "rating": self.rating,
            "vegetarian": self.vegetarian,
            "hours": self.hours,
        }


@dataclass(frozen=True)
class Hotel:
    """One hotel; price is per night for the booking."""

    id: str
    name: str
    city: str
    price_per_night: int
    rating: float
    rooms: int

    def public(self) -> dict[str, Any]:
        """What a search shows."""
        return {k: v for k, v in asdict(self).items() if k != "city"}


def _fold(value: str) -> str:
    """Case- and space-insensitive key for comparing names."""
    return value.strip().casefold()


@dataclass(frozen=True)
class World:
    """The immutable catalogue every episode of one seed shares."""

    restaurants: tuple[Restaurant, ...]
    hotels: tuple[Hotel, ...]

    def restaurant(self, restaurant_id: str) -> Restaurant | None:
        """Look a restaurant up by id (case-insensitive)."""
        return next((r for r in self.restaurants if r.id == restaurant_id.strip().upper()), None)

    def hotel(self, hotel_id: str) -> Hotel | None:
        """Look a hotel up by id (case-insensitive)."""
        return next((h for h in self.hotels if h.id == hotel_id.strip().upper()), None)

    def find_restaurants(
        self, city: str, cuisine: str | None = None, vegetarian: bool | None = None, max_price: int | None = None
    ) -> list[Restaurant]:
        """Restaurants matching the filters; vegetarian=False means 'no filter', as the tool says."""
        return [
            r
            for r in self.restaurants
            if _fold(r.city) == _fold(city)
            and (cuisine is None or _fold(r.cuisine) == _fold(cuisine))
            and (not vegetarian or r.vegetarian)
            and (max_price is None or r.price <= max_price)
        ]

    def find_hotels(self, city: str, max_price: int | None = None) -> list[Hotel]:
        """Hotels in a city at or under a nightly price."""
        return [
            h
            for h in self.hotels
            if _fold(h.city) == _fold(city) and (max_price is None or h.price_per_night <= max_price)
        ]


def make_world(seed: int) -> World:
    """Generate the catalogue for a seed."""
    rng = random.Random(f"life:{seed}:world")
    names = rng.sample([f"{a} {n}" for a in ADJECTIVES for n in NOUNS], RESTAURANTS_PER_CITY * len(CITIES))
    hotel_words = rng.sample(HOTEL_WORDS, HOTELS_PER_CITY * len(CITIES))
    restaurants: list[Restaurant] = []
    hotels: list[Hotel] = []
    for city in CITIES:
        # Every cuisine two or three times per city, so both unique and contested searches exist.
        cuisines = rng.sample(CUISINES * 3, RESTAURANTS_PER_CITY)
        for cuisine in cuisines:
            restaurants.append(
                Restaurant(
                    id=f"R-{101 + len(restaurants)}",
                    name=names[len(restaurants)],
                    city=city,
                    cuisine=cuisine,
                    price=rng.randint(1, 4),
                    rating=rng.randint(30, 50) / 10,
                    opens=rng.choice(OPENS),
                    closes=rng.choice(CLOSES),
                    vegetarian=rng.random() < 0.4,
                    seats=rng.randint(MAX_PARTY, 60),
                )
            )
        for _ in range(HOTELS_PER_CITY):
            hotels.append(
                Hotel(
                    id=f"H-{201 + len(hotels)}",
                    name=f"Hotel {hotel_words[len(hotels)]}",
                    city=city,
                    price_per_night=rng.randrange(60, 320, 5),
                    rating=rng.randint(30, 50) / 10,
                    rooms=rng.randint(5, 80),
                )
            )
    return World(tuple(restaurants), tuple(hotels))


def _spec(name: str, description: str, properties: dict[str, tuple[str, str]], required: list[str]) -> dict[str, Any]:
    """One OpenAI function spec from {param: (type, description)}."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t, "description": d} for k, (t, d) in properties.items()},
                "required": required,
            },
        },
    }


TOOL_SPECS: tuple[dict[str, Any], ...] = (
    _spec(
        "search_restaurants",
        "Find restaurants in a city. Returns a JSON list with id, name, cuisine, price, rating, vegetarian, hours.",
        {
            "city": ("string", "City name, e.g. Lisbon."),
            "cuisine": ("string", "Cuisine, e.g. Italian."),
            "vegetarian": ("boolean", "true = only vegetarian-friendly restaurants."),
            "max_price": ("integer", "Highest price level, from 1 (cheap) to 4 (expensive)."),
        },
        ["city"],
    ),
    _spec(
        "book_table",
        "Book a table for today at a restaurant, by restaurant id.",
        {
            "restaurant_id": ("string", "Restaurant id, e.g. R-101."),
            "party_size": ("integer", "Number of people."),
            "time": ("string", "Time as HH:MM (24-hour)."),
        },
        ["restaurant_id", "party_size", "time"],
    ),
    _spec(
        "search_hotels",
        "Find hotels in a city. Returns a JSON list with id, name, price_per_night, rating, rooms.",
        {
            "city": ("string", "City name, e.g. Lisbon."),
            "max_price": ("integer", "Highest price per night."),
        },
        ["city"],
    ),
    _spec(
        "book_hotel",
        "Book a hotel stay, by hotel id.",
        {
            "hotel_id": ("string", "Hotel id, e.g. H-201."),
            "check_in": ("string", "Check-in date as YYYY-MM-DD."),
            "nights": ("integer", "Number of nights."),
            "guests": ("integer", "Number of guests."),
        },
        ["hotel_id", "check_in", "nights", "guests"],
    ),
    _spec(
        "request_ride",
        "Order a taxi ride for today.",
        {
            "pickup": ("string", "Where to pick the user up."),
            "dropoff": ("string", "Where to take the user."),
            "time": ("string", "Pickup time as HH:MM (24-hour)."),
        },
        ["pickup", "dropoff", "time"],
    ),
    _spec(
        "add_event",
        "Add an event to the user's calendar.",
        {
            "title": ("string", "Event title."),
            "date": ("string", "Date as YYYY-MM-DD."),
            "time": ("string", "Time as HH:MM (24-hour)."),
        },
        ["title", "date", "time"],
    ),
)


class DomainError(Exception):
    """A request the world refuses; it becomes an {'error': ...} result, never escapes the desk."""


def _need(value: Any, parser: Any, what: str, hint: str) -> Any:
    """Parse a required argument or refuse with a message the model can act on."""
    parsed = parser(value)
    if parsed is None or parsed == "":
        raise DomainError(f"{what} must be {hint}, got {value!r}")
    return parsed


@dataclass
class Desk:
    """One episode's private booking state over the shared world."""

    world: World
    today: str
    bookings: list[dict[str, Any]] = field(default_factory=list)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Run a tool; domain errors come back as {'error': ...}; an unknown tool name raises KeyError."""
        tool = {
            "search_restaurants": self.search_restaurants,
            "book_table": self.book_table,
            "search_hotels": self.search_hotels,
            "book_hotel": self.book_hotel,
            "request_ride": self.request_ride,
            "add_event": self.add_event,
        }[name]
        args = arguments if isinstance(arguments, dict) else {}
        try:
            return json.dumps(tool(args))
        except DomainError as error:
            return json.dumps({"error": str(error)})

    def _record(self, kind: str, result: dict[str, Any]) -> dict[str, Any]:
        """Keep a successful booking for the scorer and return what the tool shows."""
        self.bookings.append({"kind": kind, **result})
        return result

    def _booking_id(self) -> str:
        """Next table, hotel or ride booking id."""
        return f"B-{1 + sum(b['kind'] != 'event' for b in self.bookings)}"

    def _city(self, value: Any) -> str:
        """A known city name, or a refusal listing the cities."""
        city = text(value)
        if city.casefold() not in {c.casefold() for c in CITIES}:
            raise DomainError(f"unknown city {value!r}; cities: {', '.join(CITIES)}")
        return city

    def _optional_int(self, args: dict[str, Any], key: str) -> int | None:
        """An optional integer filter; absent or null means no filter."""
        if args.get(key) is None:
            return None
        return _need(args[key], parse_int, key, "an integer")

    def search_restaurants(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        """Restaurants in a city, filtered."""
        city = self._city(args.get("city"))
        cuisine = text(args.get("cuisine")) or None
        vegetarian = parse_bool(args.get("vegetarian")) if args.get("vegetarian") is not None else None
        found = self.world.find_restaurants(city, cuisine, vegetarian, self._optional_int(args, "max_price"))
        return [r.public() for r in found]

    def book_table(self, args: dict[str, Any]) -> dict[str, Any]:
        """Book a table today."""
        rid = _need(args.get("restaurant_id"), text, "restaurant_id", "an id like R-101")
        party = _need(args.get("party_size"), parse_int, "party_size", "a positive integer")
        time = _need(args.get("time"), parse_time, "time", "HH:MM")
        restaurant = self.world.restaurant(rid)
        if restaurant is None:
            raise DomainError(f"unknown restaurant id {rid!r}")
        if party < 1:
            raise DomainError(f"party_size must be a positive integer, got {party}")
        if party > restaurant.seats:
            raise DomainError(f"party_size {party} is larger than {restaurant.id}'s {restaurant.seats} seats")
        if not restaurant.is_open(time):
            raise DomainError(f"{restaurant.id} ({restaurant.name}) is closed at {time}; hours {restaurant.hours}")
        result = {
            "booking_id": self._booking_id(),
            "restaurant_id": restaurant.id,
            "restaurant": restaurant.name,
            "date": self.today,
            "time": time,
            "party_size": party,
            "status": "confirmed",
        }
        return self._record("table", result)

    def search_hotels(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        """Hotels in a city, optionally under a nightly price."""
        city = self._city(args.get("city"))
        return [h.public() for h in self.world.find_hotels(city, self._optional_int(args, "max_price"))]

    def book_hotel(self, args: dict[str, Any]) -> dict[str, Any]:
        """Book a stay."""
        hid = _need(args.get("hotel_id"), text, "hotel_id", "an id like H-201")
        check_in = _need(args.get("check_in"), parse_date, "check_in", "a date YYYY-MM-DD")
        nights = _need(args.get("nights"), parse_int, "nights", "a positive integer")
        guests = _need(args.get("guests"), parse_int, "guests", "a positive integer")
        hotel = self.world.hotel(hid)
        if hotel is None:
            raise DomainError(f"unknown hotel id {hid!r}")
        if check_in < self.today:
            raise DomainError(f"check_in {check_in} is before today ({self.today})")
        if not 1 <= nights <= 30:
            raise DomainError(f"nights must be between 1 and 30, got {nights}")
        if not 1 <= guests <= 2 * hotel.rooms:
            raise DomainError(f"guests must be between 1 and {2 * hotel.rooms} at {hotel.id}, got {guests}")
        check_out = dt.date.fromisoformat(check_in) + dt.timedelta(days=nights)
        result = {
            "booking_id": self._booking_id(),
            "hotel_id": hotel.id,
            "hotel": hotel.name,
            "check_in": check_in,
            "check_out": check_out.isoformat(),
            "nights": nights,
            "guests": guests,
            "total_price": hotel.price_per_night * nights,
            "status": "confirmed",
        }
        return self._record("hotel", result)

    def request_ride(self, args: dict[str, Any]) -> dict[str, Any]:
        """Order a ride today."""
        pickup = _need(args.get("pickup"), text, "pickup", "a place name")
        dropoff = _need(args.get("dropoff"), text, "dropoff", "a place name")
        time = _need(args.get("time"), parse_time, "time", "HH:MM")
        if pickup.casefold() == dropoff.casefold():
            raise DomainError("pickup and dropoff are the same place")
        result = {
            "booking_id": self._booking_id(),
            "pickup": pickup,
            "dropoff": dropoff,
            "date": self.today,
            "time": time,
            "status": "confirmed",
        }
        return self._record("ride", result)

    def add_event(self, args: dict[str, Any]) -> dict[str, Any]:
        """Add a calendar event."""
        title = _need(args.get("title"), text, "title", "a non-empty title")
        date = _need(args.get("date"), parse_date, "date", "a date YYYY-MM-DD")
        time = _need(args.get("time"), parse_time, "time", "HH:MM")
        event_id = f"E-{1 + sum(b['kind'] == 'event' for b in self.bookings)}"
        return self._record("event", {"event_id": event_id, "title": title, "date": date, "time": time})
