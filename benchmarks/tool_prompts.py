"""Held-out function-calling prompts for `spanserve bench structured` (written for it; in no
training set we know of): a pool of functions with JSON-schema parameters, prompts that each call
one of them with the argument values they state, and prompts that no offered function fits.

Each prompt is offered its function and OFFERED - 1 others (picked per prompt, seeded), so the
model must pick the right one. `args` are the argument values checked (others the model adds are
allowed); a value {"one_of": [...]} accepts any of its alternatives (the first is canonical).
Values match leniently (`matches`): strings case-insensitively, ignoring surrounding space, a
final period and, for expressions, inner spaces; a city may carry its country ("Paris, France");
numbers by value (5 == 5.0); lists as multisets."""

import random

OFFERED = 4  # functions offered per prompt

FUNCTIONS = {
    "get_weather": {
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
    "convert_units": {
        "description": "Convert a quantity from one unit to another.",
        "parameters": {
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "from_unit": {"type": "string", "description": "Unit to convert from, e.g. km"},
                "to_unit": {"type": "string", "description": "Unit to convert to, e.g. miles"},
            },
            "required": ["value", "from_unit", "to_unit"],
        },
    },
    "create_calendar_event": {
        "description": "Create an event in the user's calendar.",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "date": {"type": "string", "description": "Date as YYYY-MM-DD"},
                "start_time": {"type": "string", "description": "Start time as HH:MM (24-hour)"},
                "duration_minutes": {"type": "integer", "minimum": 1, "maximum": 1440},
            },
            "required": ["title", "date", "start_time"],
        },
    },
    "send_email": {
        "description": "Send an email.",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {"type": "string", "description": "Recipient's email address"},
                "subject": {"type": "string"},
                "body": {"type": "string"},
            },
            "required": ["to", "subject", "body"],
        },
    },
    "web_search": {
        "description": "Search the web and return the top results.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "num_results": {"type": "integer", "minimum": 1, "maximum": 20},
            },
            "required": ["query"],
        },
    },
    "calculate": {
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
    "get_stock_price": {
        "description": "Get the latest price of a stock by its ticker symbol.",
        "parameters": {
            "type": "object",
            "properties": {
                "symbol": {"type": "string", "description": "Ticker symbol, e.g. AAPL"},
                "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
            },
            "required": ["symbol"],
        },
    },
    "set_reminder": {
        "description": "Set a reminder that goes off at a given time.",
        "parameters": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "time": {"type": "string", "description": "Time as HH:MM (24-hour)"},
                "date": {"type": "string", "description": "Date as YYYY-MM-DD; today if left out"},
            },
            "required": ["message", "time"],
        },
    },
    "translate_text": {
        "description": "Translate text into another language.",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "target_language": {"type": "string", "description": "Language to translate into, e.g. German"},
                "source_language": {"type": "string"},
            },
            "required": ["text", "target_language"],
        },
    },
}


def _lang(name: str, code: str) -> dict:
    return {"one_of": [name, code]}


# (user message, function, the argument values expected)
PROMPTS: list[tuple[str, str, dict]] = [
    ("What's the weather like in Lisbon right now?", "get_weather", {"city": "Lisbon"}),
    ("Is it raining in Seattle? Give me the temperature in fahrenheit.", "get_weather",
     {"city": "Seattle", "unit": "fahrenheit"}),
    ("How warm is it in Nairobi today, in celsius?", "get_weather", {"city": "Nairobi", "unit": "celsius"}),
    ("Check the current weather for Osaka.", "get_weather", {"city": "Osaka"}),
    ("I'm flying to Reykjavik tonight. What's the weather there?", "get_weather", {"city": "Reykjavik"}),
    ("Weather report for Buenos Aires please, in celsius.", "get_weather",
     {"city": "Buenos Aires", "unit": "celsius"}),
    ("Convert 12 kilometers to miles.", "convert_units", {"value": 12, "from_unit": {"one_of": ["kilometers", "km"]},
                                                          "to_unit": {"one_of": ["miles", "mi"]}}),
    ("How many pounds is 70 kg?", "convert_units", {"value": 70, "from_unit": {"one_of": ["kg", "kilograms"]},
                                                    "to_unit": {"one_of": ["pounds", "lb", "lbs"]}}),
    ("Convert 350 fahrenheit to celsius.", "convert_units",
     {"value": 350, "from_unit": {"one_of": ["fahrenheit", "F"]}, "to_unit": {"one_of": ["celsius", "C"]}}),
    ("What is 2.5 liters in gallons?", "convert_units",
     {"value": 2.5, "from_unit": {"one_of": ["liters", "L", "litres"]}, "to_unit": {"one_of": ["gallons", "gal"]}}),
    ("Please convert 6 feet into meters.", "convert_units",
     {"value": 6, "from_unit": {"one_of": ["feet", "ft"]}, "to_unit": {"one_of": ["meters", "m", "metres"]}}),
    ("How many ounces are in 500 grams? Convert it for me.", "convert_units",
     {"value": 500, "from_unit": {"one_of": ["grams", "g"]}, "to_unit": {"one_of": ["ounces", "oz"]}}),
    ("Add a meeting called \"Design review\" to my calendar on 2025-03-14 at 15:00 for 45 minutes.",
     "create_calendar_event", {"title": "Design review", "date": "2025-03-14", "start_time": "15:00",
                               "duration_minutes": 45}),
    ("Schedule \"Dentist appointment\" on 2025-07-02 at 09:30.", "create_calendar_event",
     {"title": "Dentist appointment", "date": "2025-07-02", "start_time": "09:30"}),
    ("Put \"Team lunch\" in my calendar for 2025-05-20 at 12:00, lasting 90 minutes.", "create_calendar_event",
     {"title": "Team lunch", "date": "2025-05-20", "start_time": "12:00", "duration_minutes": 90}),
    ("Create a calendar event titled \"Yoga class\" on 2025-11-08 starting at 18:15.", "create_calendar_event",
     {"title": "Yoga class", "date": "2025-11-08", "start_time": "18:15"}),
    ("Book \"Quarterly planning\" in the calendar: 2025-10-01, 10:00, 120 minutes.", "create_calendar_event",
     {"title": "Quarterly planning", "date": "2025-10-01", "start_time": "10:00", "duration_minutes": 120}),
    ("Make a calendar entry \"Call with Priya\" for 2025-08-19 at 16:45, 30 minutes long.",
     "create_calendar_event", {"title": "Call with Priya", "date": "2025-08-19", "start_time": "16:45",
                               "duration_minutes": 30}),
    ("Email anna@example.com with the subject \"Budget review\" and tell her the numbers are ready.",
     "send_email", {"to": "anna@example.com", "subject": "Budget review"}),
    ("Send an email to support@acme.io, subject \"Refund request\", saying my order #4411 arrived broken.",
     "send_email", {"to": "support@acme.io", "subject": "Refund request"}),
    ("Write to tom.baker@mail.com with subject \"Saturday hike\": ask if he still wants to go.", "send_email",
     {"to": "tom.baker@mail.com", "subject": "Saturday hike"}),
    ("Please email hr@company.org with the subject \"Vacation days\" asking how many I have left.", "send_email",
     {"to": "hr@company.org", "subject": "Vacation days"}),
    ("Shoot an email to li.wei@example.cn titled \"Slides\" saying the slides are attached.", "send_email",
     {"to": "li.wei@example.cn", "subject": "Slides"}),
    ("Send mail to orders@bakery.net, subject \"Cake order\", ordering a chocolate cake for Friday.", "send_email",
     {"to": "orders@bakery.net", "subject": "Cake order"}),
    ("Search the web for \"best hiking trails in Patagonia\".", "web_search",
     {"query": "best hiking trails in Patagonia"}),
    ("Find me 5 web results about \"sourdough starter recipe\".", "web_search",
     {"query": "sourdough starter recipe", "num_results": 5}),
    ("Look up \"Rust async runtime comparison\" online.", "web_search", {"query": "Rust async runtime comparison"}),
    ("Do a web search for \"electric bike tax credit 2025\" and give me 3 results.", "web_search",
     {"query": "electric bike tax credit 2025", "num_results": 3}),
    ("Search online for \"how to repot an orchid\".", "web_search", {"query": "how to repot an orchid"}),
    ("Google \"James Webb telescope latest images\" for me, 10 results.", "web_search",
     {"query": "James Webb telescope latest images", "num_results": 10}),
    ("Calculate 1234 * 56.", "calculate", {"expression": "1234 * 56"}),
    ("What is (17 + 25) / 6? Use the calculator.", "calculate", {"expression": "(17 + 25) / 6"}),
    ("Compute 2 ** 20 for me.", "calculate", {"expression": {"one_of": ["2 ** 20", "2^20"]}}),
    ("Evaluate 3.5 * (12 - 4.25).", "calculate", {"expression": "3.5 * (12 - 4.25)"}),
    ("Work out 98765 - 43210 with the calculator.", "calculate", {"expression": "98765 - 43210"}),
    ("What does 144 / 12 + 7 come to? Calculate it.", "calculate", {"expression": "144 / 12 + 7"}),
    ("What's Apple's stock trading at? The ticker is AAPL.", "get_stock_price", {"symbol": "AAPL"}),
    ("Get me the current price of MSFT.", "get_stock_price", {"symbol": "MSFT"}),
    ("How much is one share of NVDA right now, in USD?", "get_stock_price", {"symbol": "NVDA", "currency": "USD"}),
    ("Check the stock price of SAP in EUR.", "get_stock_price", {"symbol": "SAP", "currency": "EUR"}),
    ("What is TSLA trading at?", "get_stock_price", {"symbol": "TSLA"}),
    ("Look up the share price for ticker 7203 in JPY.", "get_stock_price", {"symbol": "7203", "currency": "JPY"}),
    ("Remind me to take out the trash at 19:00.", "set_reminder", {"message": "take out the trash", "time": "19:00"}),
    ("Set a reminder for 2025-04-03 at 08:00 to call the plumber.", "set_reminder",
     {"message": "call the plumber", "time": "08:00", "date": "2025-04-03"}),
    ("Remind me at 13:30 to water the plants.", "set_reminder", {"message": "water the plants", "time": "13:30"}),
    ("Please set a reminder: \"pick up the kids\" at 15:15.", "set_reminder",
     {"message": "pick up the kids", "time": "15:15"}),
    ("I need a reminder on 2025-12-24 at 10:00 to buy wrapping paper.", "set_reminder",
     {"message": "buy wrapping paper", "time": "10:00", "date": "2025-12-24"}),
    ("Set a reminder at 22:45 saying \"take medication\".", "set_reminder",
     {"message": "take medication", "time": "22:45"}),
    ("Translate \"Where is the train station?\" into German.", "translate_text",
     {"text": "Where is the train station?", "target_language": _lang("German", "de")}),
    ("How do you say \"thank you very much\" in Japanese? Translate it.", "translate_text",
     {"text": "thank you very much", "target_language": _lang("Japanese", "ja")}),
    ("Translate \"Good morning, how are you?\" to Spanish.", "translate_text",
     {"text": "Good morning, how are you?", "target_language": _lang("Spanish", "es")}),
    ("Please translate \"Je voudrais un café\" from French into English.", "translate_text",
     {"text": "Je voudrais un café", "target_language": _lang("English", "en")}),
    ("Translate the sentence \"The meeting is postponed\" into Italian.", "translate_text",
     {"text": "The meeting is postponed", "target_language": _lang("Italian", "it")}),
    ("Can you translate \"I love this city\" into Portuguese?", "translate_text",
     {"text": "I love this city", "target_language": _lang("Portuguese", "pt")}),
]

# Prompts no offered function fits: under tool_choice auto the right answer is text.
NO_TOOL_PROMPTS: list[str] = [
    "Write a haiku about autumn leaves.",
    "Hi there! How are you doing today?",
    "Tell me a short joke about penguins.",
    "What is your favourite colour, and why?",
    "Give me three tips for writing a good cover letter.",
    "Rewrite this sentence to sound more polite: \"Send me the report now.\"",
    "Explain in one sentence what a noun is.",
    "Suggest a name for my new pet goldfish.",
    "Thanks, that's all I needed!",
    "Describe the smell of fresh bread in two sentences.",
]


def tool(name: str) -> dict:
    """A function of the pool as OpenAI's tools list has it."""
    return {"type": "function", "function": {"name": name, **FUNCTIONS[name]}}


def offered(index: int, expected: str | None, count: int = OFFERED) -> list[str]:
    """The functions offered to prompt `index`: `expected` (if any) among others, shuffled; seeded
    by the prompt's index, so every run offers the same."""
    rng = random.Random(f"tool-prompt-{index}")
    others = sorted(n for n in FUNCTIONS if n != expected)
    names = ([expected] if expected else []) + rng.sample(others, count - (1 if expected else 0))
    rng.shuffle(names)
    return names


def canonical(value):
    """An expected value with each {"one_of": [...]} replaced by its first alternative."""
    if isinstance(value, dict) and set(value) == {"one_of"}:
        return canonical(value["one_of"][0])
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def _norm(text: str, squeeze: bool) -> str:
    text = " ".join(text.strip().casefold().split()).rstrip(".")
    return text.replace(" ", "") if squeeze else text


def matches(expected, actual, key: str = "") -> bool:
    """`actual` (what the model passed) is `expected`, leniently (see the module docstring)."""
    if isinstance(expected, dict) and set(expected) == {"one_of"}:
        return any(matches(e, actual, key) for e in expected["one_of"])
    if isinstance(expected, bool) or isinstance(actual, bool):
        return expected is actual
    if isinstance(expected, (int, float)):
        if isinstance(actual, str):
            try:
                actual = float(actual)
            except ValueError:
                return False
        return isinstance(actual, (int, float)) and abs(float(actual) - float(expected)) <= 1e-9 * max(1, abs(expected))
    if isinstance(expected, str):
        if not isinstance(actual, str):
            return isinstance(actual, (int, float)) and matches(actual, expected)  # a ticker 7203 given as a number
        squeeze = key == "expression"
        e, a = _norm(expected, squeeze), _norm(actual, squeeze)
        return a == e or (key == "city" and a.startswith(e + ","))
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return False
        left = list(actual)
        for e in expected:
            hit = next((i for i, a in enumerate(left) if matches(e, a, key)), None)
            if hit is None:
                return False
            left.pop(hit)
        return True
    return expected == actual


def values_match(expected: dict, arguments) -> bool:
    """Every expected argument is present in `arguments` (a dict) with a matching value."""
    return isinstance(arguments, dict) and all(k in arguments and matches(v, arguments[k], k)
                                               for k, v in expected.items())
