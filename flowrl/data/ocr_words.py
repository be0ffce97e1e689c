"""Our own word list for OCR prompts: short, common, easy-to-render English words.

Chosen for this project (not taken from another dataset): shop-sign and poster vocabulary,
3 to 8 letters, no proper names, nothing offensive. Kept as a tuple so it ships with the code.
"""

# Ten words a line reads better than one, so the formatter is kept off this literal.
# fmt: off
OCR_WORDS: tuple[str, ...] = (
    "open", "closed", "bakery", "coffee", "books", "garden", "market", "fresh", "bread", "sale",
    "hello", "world", "music", "dance", "night", "light", "river", "ocean", "beach", "summer",
    "winter", "spring", "autumn", "forest", "mountain", "valley", "harbor", "island", "desert", "meadow",
    "tiger", "eagle", "rabbit", "dragon", "robot", "rocket", "planet", "comet", "star", "moon",
    "sun", "cloud", "rain", "snow", "storm", "thunder", "breeze", "shadow", "silver", "golden",
    "purple", "orange", "green", "yellow", "crimson", "blue", "white", "black", "happy", "lucky",
    "brave", "quiet", "gentle", "wild", "simple", "modern", "vintage", "classic", "royal", "cosmic",
    "pizza", "pasta", "noodle", "burger", "taco", "sushi", "bagel", "donut", "cookie", "candy",
    "lemon", "apple", "cherry", "mango", "peach", "melon", "honey", "maple", "ginger", "mint",
    "studio", "gallery", "museum", "library", "theater", "cinema", "station", "airport", "hotel", "diner",
    "pharmacy", "florist", "barber", "tailor", "repair", "garage", "parking", "exit", "entrance", "welcome",
    "stop", "yield", "slow", "danger", "caution", "silence", "push", "pull", "free", "today",
    "tomorrow", "forever", "always", "never", "dream", "hope", "love", "peace", "joy", "smile",
    "create", "explore", "discover", "imagine", "wonder", "believe", "build", "learn", "play", "travel",
    "journey", "story", "legend", "secret", "magic", "spark", "pixel", "signal", "vector", "matrix",
    "flow", "motion", "rhythm", "echo", "pulse", "wave", "orbit", "galaxy", "nebula", "aurora",
    "lantern", "candle", "mirror", "window", "bridge", "tower", "castle", "village", "city", "street",
    "avenue", "corner", "bazaar", "square", "plaza", "park", "zoo", "farm", "ranch", "harvest",
    "kitchen", "table", "chair", "basket", "bottle", "teapot", "compass", "anchor", "sail", "voyage",
    "north", "south", "east", "west", "first", "second", "third", "grand", "little", "big",
)
# fmt: on
