"""DFlash's settings: the backbone's (`drafters/settings.py`), and none of its own."""

from dflash_cache.drafters.settings import DrafterSettings

SETTINGS = DrafterSettings
