from .cli import convert_main

convert_main()
