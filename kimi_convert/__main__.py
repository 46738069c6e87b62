from .cli.convert import convert_main

convert_main()
