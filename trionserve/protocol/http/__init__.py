"""HTTP/REST frontend: the KServe v2 protocol plus Triton's extensions over h11.

``codec`` turns JSON / binary-tensor bodies into core requests and back (pure),
``generate`` the same for the generate extension, ``transport`` the h11 server on
Trio sockets, ``frontend`` the route table and its handlers over the DataPlane."""
