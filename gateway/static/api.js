// Starts Swagger UI (served by Herald from the swagger-ui-py wheel) on Herald's OpenAPI document.
// No validator badge (it would call validator.swagger.io) and no top bar to load other documents.
"use strict";
window.addEventListener("DOMContentLoaded", () => {
  window.ui = window.SwaggerUIBundle({
    url: "/schema/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null,
    presets: [window.SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
